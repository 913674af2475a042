"""SGLang model class ``TinyHybridForCausalLM`` of the tiny hybrid model (``docs/design.md``,
"Tiny hybrid model"), built from the reference model's own modules
(``sglang_mamba_ext.models.tiny_hybrid``: embedding, decoder layers, final norm); only the
state-touching cores are SGLang's: ``RadixAttention`` for full-attention layers (K/V in
SGLang's KV pool, softmax by the configured attention backend, e.g. ``torch_native``),
``RadixLinearAttention`` -> ``HybridLinearAttnBackend`` ->
:class:`~sglang_mamba_ext.plugin.tiny_hybrid.backend.TinyHybridLinearAttnBackend` for linear
layers (the mixer's segment runner on the Mamba pool's per-request states), and
``LogitsProcessor`` over ``lm_head`` (one rank). Parameter names equal the checkpoint's
(``model.layers.{i}.self_attn.q_proj.weight``, ...).
"""

from __future__ import annotations

from typing import Iterable, Optional, Tuple

import torch
from torch import nn

from sglang.srt.layers.logits_processor import LogitsProcessor
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.layers.radix_linear_attention import RadixLinearAttention

from sglang_mamba_ext.models.linear_attn import GatedDeltaRuleMixer
from sglang_mamba_ext.models.tiny_hybrid import TinyHybridConfig, TinyHybridModel


class TinyHybridRadixLinearAttention(RadixLinearAttention):
    """``RadixLinearAttention`` that carries a reference to its layer's mixer, so the backend
    calls the shared math (``mixer.run_segments``, ``mixer.conv / split_qkv``).

    The mixer is stored outside ``nn.Module`` registration: its parameters belong to the
    decoder layer (``model.layers.{i}.linear_attn.*``) and must not appear twice."""

    def __init__(self, layer_id: int, mixer: GatedDeltaRuleMixer) -> None:
        s = mixer.shape
        H, HV, K, V = s.num_k_heads, s.num_v_heads, s.head_k_dim, s.head_v_dim
        # (layer_id, num_q/k/v_heads, head_q/k/v_dim): q shares the key heads' layout
        super().__init__(layer_id, H, H, HV, K, K, V)
        object.__setattr__(self, "mixer", mixer)


class TinyHybridForCausalLM(nn.Module):
    """SGLang entry class for ``architectures: ["TinyHybridForCausalLM"]``."""

    def __init__(self, config: TinyHybridConfig, quant_config=None, prefix: str = "") -> None:
        super().__init__()
        if quant_config is not None:
            raise ValueError("TinyHybridForCausalLM: quantization is not supported (drop --quantization)")
        self.config = config
        self.model = TinyHybridModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.logits_processor = LogitsProcessor(config)
        cores = {}
        for layer in self.model.layers:
            i = layer.layer_id
            if layer.is_linear:
                cores[str(i)] = TinyHybridRadixLinearAttention(i, layer.linear_attn)
            else:
                attn = layer.self_attn
                cores[str(i)] = RadixAttention(
                    num_heads=attn.num_heads,
                    head_dim=attn.head_dim,
                    scaling=attn.scaling,
                    num_kv_heads=attn.num_kv_heads,
                    layer_id=i,
                    prefix=f"model.layers.{i}.self_attn.attn",
                )
        self.attn_cores = nn.ModuleDict(cores)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        forward_batch,
        input_embeds: Optional[torch.Tensor] = None,
        get_embedding: bool = False,
        **kwargs,
    ):
        """``input_ids`` ``[T]`` and ``positions`` ``[T]`` of all rows of the batch
        (concatenated); returns SGLang's ``LogitsProcessorOutput``."""
        h = self.model.embed_tokens(input_ids) if input_embeds is None else input_embeds
        T = h.shape[0]
        for layer in self.model.layers:
            x = layer.input_layernorm(h)
            core = self.attn_cores[str(layer.layer_id)]
            if layer.is_linear:
                mixer = layer.linear_attn
                s = mixer.shape
                # raw gates, as SGLang's KDA/GDN layers hand them to their backends; the
                # backend activates them (mixer.activate_gates)
                mixed_qkv, g_raw, b_raw = mixer.project_raw(x)
                o = core(forward_batch, mixed_qkv, g_raw, b_raw)
                y = mixer.finish(o.reshape(T, s.num_v_heads, s.head_v_dim), x)
            else:
                attn = layer.self_attn
                q, k, v = attn.project_qkv(x, positions)
                o = core(q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1), forward_batch)
                y = attn.finish(o.reshape(T, attn.num_heads, attn.head_dim))
            h = layer.mlp_block(h + y)
        h = self.model.norm(h)
        return self.logits_processor(input_ids, h, self.lm_head, forward_batch)

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors into parameters of the same name (:func:`copy_weights`;
        a tied ``lm_head.weight`` is skipped).

        Raises:
            ValueError: a tensor with no matching parameter, a shape mismatch, or a
                parameter missing from the checkpoint (wrong model directory)."""
        skip = {"lm_head.weight"} if self.config.tie_word_embeddings else set()
        copy_weights(self, weights, skip=skip)


def copy_weights(module: nn.Module, weights: Iterable[Tuple[str, torch.Tensor]], skip=frozenset()) -> None:
    """Copy each ``(name, tensor)`` of a checkpoint into ``module``'s parameter of that
    name (cast to its dtype), except names in ``skip``.

    Raises:
        ValueError: a tensor with no matching parameter, a shape mismatch, or a parameter
            missing from the checkpoint (wrong model directory or config.json)."""
    owner = type(module).__name__
    params = dict(module.named_parameters())
    loaded = set()
    for name, tensor in weights:
        if name in skip:
            continue
        p = params.get(name)
        if p is None:
            raise ValueError(f"{owner}: checkpoint tensor {name!r} has no parameter")
        if tuple(p.shape) != tuple(tensor.shape):
            raise ValueError(
                f"{owner}: {name} has shape {tuple(tensor.shape)} in the "
                f"checkpoint, {tuple(p.shape)} in the model (config.json mismatch)"
            )
        with torch.no_grad():
            p.copy_(tensor.to(p.dtype))
        loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"{owner}: checkpoint lacks {missing}")


EntryClass = TinyHybridForCausalLM
