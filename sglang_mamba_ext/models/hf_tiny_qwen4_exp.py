"""A tiny Qwen4-Exp checkpoint (issue 40): SGLang 0.5.23's ``Qwen4ExpForConditionalGeneration``
(``sglang/srt/models/qwen4_exp.py``, config ``Qwen4ExpConfig``, ``configs/qwen4_exp.py``), built by
transformers' own class of the same name (transformers 5.19 has ``models/qwen4_exp``).

Qwen3.5's layers (Gated DeltaNet / gated attention, a routed MoE with a gated shared expert: SGLang
runs every ``qwen4_exp_text`` layer sparse, ``models/qwen3_5.py:165``) inside gated
hyper-connections (``hc_count`` residual streams, ``attn_hyper_connection`` /
``mlp_hyper_connection`` per layer, ``hyper_connection_mixer`` at the output; no layer norms), and
on the layers named by ``ple_layer_ids`` (1-based, linear layers only) a Per-Layer Embedding:
hashed 2- / 3-gram embeddings (``ngram_size`` 3) gate a value per stream, and a **dilated** depthwise
conv (kernel ``ple_conv_kernel_size``, dilation ``ngram_size``) adds local context. Its two states
per request are SGLang's PLE side states (``mem_cache/ple_state_pool.py``): a conv window of
``(kernel - 1) * ngram_size`` = 9 columns of ``hidden * hc_count`` channels per PLE layer, and the
last ``ngram_size - 1`` = 2 token ids (the n-gram history, one per request).

Sizes: hidden 64, 4 layers (linear, full, linear, full), ``hc_count`` 2 (SGLang refuses 1,
``configs/qwen4_exp.py``), ``hc_lowrank`` 16, PLE on both linear layers, ``heads_per_ngram`` 2
(4 n-gram heads of 16), ``ngram_vocab_size_base`` 100 (each head's table: the next primes above
it; 512 rows per PLE layer after padding, so the checkpoint stays under 1 MB). Served in bfloat16: SGLang builds the hyper-connection weights and the n-gram tables in
bfloat16 whatever the model's dtype (``layers/hyperconnection.py`` ``HyperConnectionConfig``,
``models/qwen4_exp.py`` ``Qwen4ExpNGramEmbedding``), so a float16 checkpoint would mix dtypes.

Checkpoint layout: transformers saves each n-gram table as ``...ple.ple_embedding.ngram_embedding
.weight``; SGLang's loader reads only row shards ``ngram_embedding.shard_<i>.weight``
(``load_qwen4_exp_ple_shard``, ``split_ngram_parts`` shards) and refuses the plain name, so the
served file holds each table as ``shard_0`` (``split_ngram_parts`` 1) and transformers' own file
stays beside it (``hf_reference/``) for the float32 reference.
"""

from __future__ import annotations

import json
import os
from typing import Dict

#: The vision tower and token ids of the Qwen3.5 VLMs (``hf_tiny_families._qwen35_vlm``)
_VISION = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, in_channels=3, patch_size=16,
               spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
               hidden_act="gelu_pytorch_tanh")


#: transformers' Qwen4-Exp builds every full-attention layer as QSA (an indexer picks key blocks);
#: with a budget above any prompt here every block is picked, which is dense causal attention.
#: These fields (and the indexer weights) are for transformers only: :func:`rewrite_shards` drops
#: them from the served files, so SGLang builds plain attention (``is_qwen_qsa`` false,
#: ``layers/attention/qsa/config.py:91``; QSA has no CPU path).
_DENSE_QSA = dict(indexer_n_heads=1, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=4096,
                  indexer_compress_ratio=64)


def qwen4_exp_family(hidden: int, layers: int, gdn_layers: Dict, mrope: Dict) -> Dict[str, Dict]:
    """The ``qwen4_exp`` entry of :mod:`.hf_tiny`'s family table: Qwen3.5's GDN / attention sizes
    (``gdn_layers``, ``hf_tiny_families._qwen_gdn_layers()``) and M-RoPE (``mrope``), the MoE of
    the Qwen3.5 MoE family, the hyper-connection and PLE fields of the module docstring."""
    text = dict(
        model_type="qwen4_exp_text", hidden_size=hidden, num_hidden_layers=layers, **gdn_layers,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        rope_parameters=dict(mrope), partial_rotary_factor=mrope["partial_rotary_factor"],
        rope_theta=mrope["rope_theta"], attn_output_gate=True, rms_norm_eps=1e-6, attention_bias=False,
        hc_count=2, hc_lowrank=16, ple_layer_ids=[i + 1 for i in range(0, layers, 2)], ple_embed_dim=hidden,
        ple_conv_kernel_size=4, ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=100,
        make_ngram_vocab_size_divisible_by=128, seed=1234, split_ngram_parts=1,
        **_DENSE_QSA,
    )
    return {"qwen4_exp": dict(
        cls="Qwen4ExpForConditionalGeneration", sub="text_config", dtype="bfloat16", spread_experts=True,
        tune=live_ple, rewrite=rewrite_shards, writes_reference=True,
        config=dict(
            model_type="qwen4_exp", image_token_id=760, video_token_id=761, vision_start_token_id=762,
            vision_end_token_id=763, text_config=text,
            vision_config=dict(model_type="qwen4_exp_vision", out_hidden_size=hidden, deepstack_visual_indexes=[],
                               **_VISION),
        ),
    )}


def live_ple(model) -> None:
    """transformers leaves the PLE conv at its init; give the dilated conv weights N(0, 1/k) and
    the n-gram tables N(0, 1) so both PLE states reach the outputs (the conv reads tokens 3, 6 and
    9 back)."""
    import torch

    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("ple.conv1d.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
            elif name.endswith("ngram_embedding.weight"):
                p.copy_(torch.randn(p.shape, generator=gen))


def rewrite_shards(out_dir: str, reference_subdir: str) -> None:
    """Keep transformers' checkpoint in ``out_dir/reference_subdir`` (the float32 reference reads
    it), rename each n-gram table in the served file to SGLang's one-shard name
    (``...ngram_embedding.shard_0.weight``, module docstring) and drop the QSA indexer
    (:data:`_DENSE_QSA`) from the served weights and config."""
    import shutil

    from safetensors.torch import load_file, save_file

    ref = os.path.join(out_dir, reference_subdir)
    os.makedirs(ref, exist_ok=True)
    for name in ("model.safetensors", "config.json"):
        shutil.copyfile(os.path.join(out_dir, name), os.path.join(ref, name))
    path = os.path.join(out_dir, "model.safetensors")
    state = load_file(path)
    out = {}
    for name, t in state.items():
        if ".self_attn.indexer." in name:
            continue
        if name.endswith(".ngram_embedding.weight"):
            name = name[: -len(".weight")] + ".shard_0.weight"
        out[name] = t.contiguous()
    save_file(out, path, metadata={"format": "pt"})
    cfg_path = os.path.join(out_dir, "config.json")
    with open(cfg_path, encoding="utf-8") as f:
        cfg = json.load(f)
    for key in _DENSE_QSA:
        cfg["text_config"].pop(key, None)
    with open(cfg_path, "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")
