"""SGLang model class of the tiny frozen-KV draft, ``TinyHybridDraftForCausalLM``
(math and parameters: :mod:`sglang_mamba_ext.models.tiny_draft`).

It implements what SGLang 0.5.23's FROZEN_KV_MTP worker reads from a draft model
(``srt/speculative/frozen_kv_mtp_worker_v2.py``; the interface of ``srt/models/gemma4_mtp.py``):
``build_frozen_kv_mtp_context`` (draft layer ``i`` -> target layer ``target_layer_ids[i]``),
``bind_frozen_kv_context`` (each ``RadixAttention`` takes the target layer's id, so the worker's
pool swap makes it read the target's K/V) and ``backbone_hidden_size``. The attention never
writes K/V (``save_kv_cache=False``): the target pool is read-only for the draft. The recurrent
hidden arrives in ``forward_batch.spec_info.hidden_states`` ``[N, backbone_hidden_size]``.
"""

from __future__ import annotations

from typing import Iterable, Optional, Tuple

import torch
from torch import nn

from sglang.srt.layers.logits_processor import LogitsProcessor
from sglang.srt.layers.radix_attention import RadixAttention

from sglang_mamba_ext.models.tiny_draft import TinyHybridDraftConfig, TinyHybridDraftCore
from sglang_mamba_ext.plugin.tiny_hybrid.model import copy_weights


class TinyHybridDraftForCausalLM(nn.Module):
    """SGLang entry class for ``architectures: ["TinyHybridDraftForCausalLM"]``."""

    def __init__(self, config: TinyHybridDraftConfig, quant_config=None, prefix: str = "") -> None:
        super().__init__()
        if quant_config is not None:
            raise ValueError("TinyHybridDraftForCausalLM: quantization is not supported (drop --quantization)")
        self.config = config
        core = TinyHybridDraftCore(config)
        self.model = core.model
        self.pre_projection = core.pre_projection
        self.lm_head = core.lm_head
        #: Width of the target hidden states this draft consumes (SGLang's name).
        self.backbone_hidden_size = int(config.backbone_hidden_size)
        self.logits_processor = LogitsProcessor(config)
        self.attn_cores = nn.ModuleList(
            RadixAttention(
                num_heads=layer.self_attn.num_heads,
                head_dim=layer.self_attn.head_dim,
                scaling=layer.self_attn.scaling,
                num_kv_heads=layer.self_attn.num_kv_heads,
                layer_id=i,
                prefix=f"model.layers.{i}.self_attn.attn",
            )
            for i, layer in enumerate(self.model.layers)
        )
        self.kv_context = None

    # -- FROZEN_KV_MTP interface ---------------------------------------------------------

    def build_frozen_kv_mtp_context(self, target_model, target_token_to_kv_pool):
        """Map draft layer ``i`` to target layer ``config.target_layer_ids[i]``.

        Raises:
            ValueError: that target layer is not a full-attention layer of ``target_model``."""
        from sglang.srt.speculative.frozen_kv_mtp_info import FrozenKVMTPContext

        tcfg = getattr(target_model, "config", None)
        full = set(getattr(tcfg, "full_attention_layer_ids", []) or [])
        physical = {}
        for i, t in enumerate(self.config.target_layer_ids):
            if full and t not in full:
                raise ValueError(
                    f"TinyHybridDraftForCausalLM: draft layer {i} reads target layer {t}, which is not a "
                    f"full-attention layer of the target (full-attention layers: {sorted(full)})"
                )
            physical[i] = int(t)
        return FrozenKVMTPContext(target_token_to_kv_pool=target_token_to_kv_pool, physical_layer_ids=physical)

    def bind_frozen_kv_context(self, ctx) -> None:
        """Point each draft attention at its target layer's K/V."""
        for i, core in enumerate(self.attn_cores):
            core.layer_id = ctx.get_physical_layer_id(i)
        self.kv_context = ctx

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    # -- forward -------------------------------------------------------------------------

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch,
                input_embeds: Optional[torch.Tensor] = None, **kwargs):
        """``input_ids`` ``[N]``, ``positions`` ``[N]`` (``seq_len - 1`` per row: the frozen
        RoPE phase the worker sets); returns SGLang's ``LogitsProcessorOutput``.

        Raises:
            RuntimeError: no recurrent hidden in ``forward_batch.spec_info.hidden_states``."""
        emb = self.model.embed_tokens(input_ids) if input_embeds is None else input_embeds
        spec = getattr(forward_batch, "spec_info", None)
        prev = getattr(spec, "hidden_states", None)
        if prev is None:
            raise RuntimeError("TinyHybridDraftForCausalLM: forward_batch.spec_info.hidden_states is required")
        h = self.pre_projection(torch.cat([emb, prev.to(emb.dtype)], dim=-1))
        T = h.shape[0]
        for layer, core in zip(self.model.layers, self.attn_cores):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q, k, v = attn.project_qkv(x, positions)
            o = core(q.reshape(T, attn.num_heads * attn.head_dim), k.reshape(T, attn.num_kv_heads * attn.head_dim),
                     v.reshape(T, attn.num_kv_heads * attn.head_dim), forward_batch, save_kv_cache=False)
            h = layer.mlp_block(h + attn.finish(o.reshape(T, attn.num_heads, attn.head_dim)))
        h = self.model.norm(h)
        return self.logits_processor(input_ids, h, self.lm_head, forward_batch)

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors into parameters of the same name (the target's
        :func:`~sglang_mamba_ext.plugin.tiny_hybrid.model.copy_weights`).

        Raises:
            ValueError: an unknown tensor, a shape mismatch or a missing parameter."""
        copy_weights(self, weights)


EntryClass = TinyHybridDraftForCausalLM
