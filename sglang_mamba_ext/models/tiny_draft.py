"""Tiny frozen-KV draft for the tiny hybrid target (issue 12, item 1; SGLang's FROZEN_KV_MTP,
``sglang/srt/speculative/frozen_kv_mtp_worker_v2.py``, modelled on ``srt/models/gemma4_mtp.py``).

The draft owns no KV and no SSM state. One draft step for a request whose committed sequence
has ``seq_len`` tokens takes the last sampled token ``x`` and the recurrent hidden ``h_prev``
``[hidden]`` (the target's last hidden state on the first step, the draft's own afterwards):

    z = pre_projection([embed(x), h_prev])                    # [hidden]
    for each draft layer i (all full attention):
        z += o_proj(attn(q(z) at RoPE position seq_len - 1,    # frozen position
                         K/V of target layer target_layer_ids[i], tokens 0..seq_len-1))
        z  = mlp_block(z)
    logits = lm_head(norm(z)); hidden handed on = norm(z)

reading the target's KV read-only (no K/V of its own tokens). The draft has no linear-attention
layers. :func:`draft_init_from_target` copies the target's embedding, head, final norm and its
full-attention layers, and sets ``pre_projection = [I | 0]``, so the draft is "the target
without its linear layers"; it agrees with the target on some tokens only, so accept lengths
vary. Parameter names: ``model.embed_tokens.weight``, ``pre_projection.weight``
``[hidden, 2*hidden]``, ``model.layers.{i}.*`` (as the target's decoder layers),
``model.norm.weight``, ``lm_head.weight``.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
from torch import nn

from sglang_mamba_ext.models.tiny_hybrid import (
    FULL_ATTENTION,
    TinyHybridConfig,
    TinyHybridModel,
)

__all__ = ["DRAFT_MODEL_TYPE", "DRAFT_ARCHITECTURE", "TinyHybridDraftConfig", "TinyHybridDraftCore",
           "draft_init_from_target"]

DRAFT_MODEL_TYPE = "tiny_hybrid_draft"
DRAFT_ARCHITECTURE = "TinyHybridDraftForCausalLM"


class TinyHybridDraftConfig(TinyHybridConfig):
    """Config of the tiny frozen-KV draft (``model_type = "tiny_hybrid_draft"``).

    Same fields as :class:`TinyHybridConfig` (every ``layer_types`` entry must be
    ``"full_attention"``) plus ``target_layer_ids`` (target layer whose KV draft layer ``i``
    reads) and ``backbone_hidden_size`` (hidden size of the target's hidden states, SGLang's
    name).

    Raises:
        ValueError: a linear-attention layer, or ``target_layer_ids`` not one per layer.
    """

    model_type = DRAFT_MODEL_TYPE

    def __init__(self, target_layer_ids: Optional[List[int]] = None,
                 backbone_hidden_size: Optional[int] = None, **kwargs) -> None:
        kwargs.setdefault("num_hidden_layers", 1)
        kwargs.setdefault("layer_types", [FULL_ATTENTION] * kwargs["num_hidden_layers"])
        super().__init__(**kwargs)
        if any(t != FULL_ATTENTION for t in self.layer_types):
            raise ValueError(f"{DRAFT_MODEL_TYPE}: every draft layer must be full_attention, got {self.layer_types}")
        self.target_layer_ids = list(target_layer_ids if target_layer_ids is not None
                                     else range(self.num_hidden_layers))
        if len(self.target_layer_ids) != self.num_hidden_layers:
            raise ValueError(
                f"{DRAFT_MODEL_TYPE}: target_layer_ids {self.target_layer_ids} must name one target "
                f"layer per draft layer ({self.num_hidden_layers})"
            )
        self.backbone_hidden_size = int(backbone_hidden_size or self.hidden_size)


class TinyHybridDraftCore(nn.Module):
    """Parameters of the draft (names as in the checkpoint); the forward lives in the SGLang
    class (``plugin/tiny_hybrid/draft_model.py``), which runs attention through SGLang."""

    def __init__(self, config: TinyHybridDraftConfig) -> None:
        super().__init__()
        self.config = config
        self.model = TinyHybridModel(config)
        self.pre_projection = nn.Linear(config.hidden_size + config.backbone_hidden_size,
                                        config.hidden_size, bias=False)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)


def draft_config_for(target: TinyHybridConfig) -> Dict:
    """``config.json`` fields of the draft matching ``target``: one draft layer per target
    full-attention layer, same sizes and vocabulary."""
    full = target.full_attention_layer_ids
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
            "num_key_value_heads", "head_dim", "rope_theta", "max_position_embeddings",
            "rms_norm_eps", "bos_token_id", "eos_token_id", "pad_token_id")
    cfg = {k: getattr(target, k) for k in keys}
    cfg.update(num_hidden_layers=len(full), layer_types=[FULL_ATTENTION] * len(full),
               target_layer_ids=list(full), backbone_hidden_size=target.hidden_size,
               tie_word_embeddings=False)
    return cfg


@torch.no_grad()
def draft_init_from_target(draft: TinyHybridDraftCore, target_state: Dict[str, torch.Tensor]) -> None:
    """Initialise ``draft`` from a target checkpoint ``target_state`` (name -> tensor):
    embedding, head, final norm, draft layer ``i`` = target layer ``target_layer_ids[i]``,
    ``pre_projection = [I | 0]`` (the recurrent hidden is read but weighted 0).

    Raises:
        KeyError: a target tensor is missing (not a tiny hybrid checkpoint)."""
    c = draft.config
    draft.model.embed_tokens.weight.copy_(target_state["model.embed_tokens.weight"])
    draft.lm_head.weight.copy_(target_state.get("lm_head.weight", target_state["model.embed_tokens.weight"]))
    draft.model.norm.weight.copy_(target_state["model.norm.weight"])
    for i, t in enumerate(c.target_layer_ids):
        prefix = f"model.layers.{t}."
        for name, p in draft.model.layers[i].named_parameters():
            p.copy_(target_state[prefix + name])
    w = torch.zeros_like(draft.pre_projection.weight)
    w[:, : c.hidden_size] = torch.eye(c.hidden_size)
    draft.pre_projection.weight.copy_(w)
