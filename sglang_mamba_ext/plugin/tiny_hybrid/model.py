"""SGLang model class ``TinyHybridForCausalLM`` of the tiny hybrid model (``docs/design.md``,
"Tiny hybrid model"), built from the reference model's own modules
(``sglang_mamba_ext.models.tiny_hybrid``: embedding, decoder layers, final norm); only the
state-touching cores are SGLang's: ``RadixAttention`` for full-attention layers (K/V in
SGLang's KV pool, softmax by the configured attention backend, e.g. ``torch_native``),
``RadixLinearAttention`` -> ``HybridLinearAttnBackend`` ->
:class:`~sglang_mamba_ext.plugin.tiny_hybrid.backend.TinyHybridLinearAttnBackend` for linear
layers (the mixer's segment runner on the Mamba pool's per-request states), and
``LogitsProcessor`` over ``lm_head``. Parameter names equal the checkpoint's
(``model.layers.{i}.self_attn.q_proj.weight``, ...).

Tensor parallelism (``--tp N``, or the attention-TP width under DP attention): each rank builds
its modules from :func:`sglang_mamba_ext.models.tiny_shard.rank_config` (its share of the
attention and linear-attention heads), loads its slices of the checkpoint
(:func:`~sglang_mamba_ext.models.tiny_shard.shard_tensor`) and all-reduces the two row-parallel
outputs (``o_proj``, ``out_proj``) over SGLang's attention-TP group; embeddings, MLPs and
``lm_head`` are whole on every rank, so the logits need no gather.
"""

from __future__ import annotations

from typing import Iterable, Optional, Tuple

import torch
from torch import nn

from sglang.srt.distributed.communication_op import attention_tensor_model_parallel_all_reduce
from sglang.srt.layers.logits_processor import LogitsProcessor
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.layers.radix_linear_attention import RadixLinearAttention

from sglang_mamba_ext.models.linear_attn import GatedDeltaRuleMixer
from sglang_mamba_ext.models.tiny_hybrid import TinyHybridConfig, TinyHybridModel
from sglang_mamba_ext.models.tiny_shard import rank_config, shard_tensor


def attn_tp() -> Tuple[int, int]:
    """``(rank, size)`` of this process in SGLang's attention-TP group (``(0, 1)`` outside a
    model runner)."""
    try:
        from sglang.srt.runtime_context import get_parallel

        p = get_parallel()
        return int(p.attn_tp_rank), int(p.attn_tp_size)
    except Exception:
        return 0, 1


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
        self.tp_rank, self.tp_size = attn_tp()
        self.model = TinyHybridModel(rank_config(config, self.tp_size))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # lm_head is whole on every rank: full-vocabulary logits, nothing to gather
        self.logits_processor = LogitsProcessor(config, skip_all_gather=True)
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
                g_raw, b_raw = self.linear_gate_inputs(forward_batch, mixer, g_raw, b_raw)
                o = core(forward_batch, mixed_qkv, g_raw, b_raw)
                y = mixer.finish(o.reshape(T, s.num_v_heads, s.head_v_dim), x)
                if self.tp_size > 1:  # out_proj is row parallel
                    y = attention_tensor_model_parallel_all_reduce(y)
            else:
                attn = layer.self_attn
                q, k, v = attn.project_qkv(x, positions)
                # explicit widths: an idle DP-attention rank runs an empty batch (T = 0)
                o = core(q.reshape(T, attn.num_heads * attn.head_dim), k.reshape(T, attn.num_kv_heads * attn.head_dim),
                         v.reshape(T, attn.num_kv_heads * attn.head_dim), forward_batch)
                y = attn.finish(o.reshape(T, attn.num_heads, attn.head_dim))
                if self.tp_size > 1:  # o_proj is row parallel
                    y = attention_tensor_model_parallel_all_reduce(y)
            h = layer.mlp_block(h + y)
        h = self.model.norm(h)
        return self.logits_processor(input_ids, h, self.lm_head, forward_batch)

    def linear_gate_inputs(self, forward_batch, mixer: GatedDeltaRuleMixer, g_raw: torch.Tensor,
                           b_raw: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """The raw gates as this model's linear backend takes them: unchanged (``g_raw``
        ``[T, gate_dim]``, ``b_raw`` ``[T, HV]``) for the tiny backend."""
        return g_raw, b_raw

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors into parameters of the same name (:func:`copy_weights`;
        a tied ``lm_head.weight`` is skipped), each cut to this rank's slice under tensor
        parallelism.

        Raises:
            ValueError: a tensor with no matching parameter, a shape mismatch, or a
                parameter missing from the checkpoint (wrong model directory)."""
        skip = {"lm_head.weight"} if self.config.tie_word_embeddings else set()
        rank, tp = self.tp_rank, self.tp_size
        copy_weights(self, ((n, shard_tensor(n, t, self.config, rank, tp)) for n, t in weights), skip=skip)


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


class TinyHybridSGLangKernelsForCausalLM(TinyHybridForCausalLM):
    """The tiny hybrid model with its linear layers served by SGLang's own linear-attention
    backends (``architectures: ["TinyHybridGDNForCausalLM"]`` -> ``GDNAttnBackend``,
    ``["TinyHybridKDAForCausalLM"]`` -> ``KDAAttnBackend``; ``--linear-kernels sglang`` of
    ``scripts/make_tiny_model.py``). Same weights and math as :class:`TinyHybridForCausalLM`;
    each linear core is a plain ``RadixLinearAttention`` carrying what SGLang's backends read
    from a Qwen3-Next / Kimi-Linear layer: the conv taps ``conv_weights`` ``[conv_dim, W]``,
    ``bias``, ``activation="silu"``, ``A_log`` (GDN ``[HV]``; KDA viewed ``[1, 1, HV, 1]``) and
    ``dt_bias``. On a host without CUDA SGLang's Triton kernels run under Triton's interpreter
    (``plugin/triton_interpret.py``; serve in float16, the dtype checked in serving: SGLang's
    chunked GDN kernel refuses float32). The KDA variant needs Kimi-Linear's head layout (equal
    key/value heads and dims; ``config.TinyHybridSGLangConfig.mamba2_cache_params``)."""

    def __init__(self, config: TinyHybridConfig, quant_config=None, prefix: str = "") -> None:
        super().__init__(config, quant_config, prefix)
        from sglang_mamba_ext.plugin.triton_interpret import install_interpreter_shims

        install_interpreter_shims()
        for layer in self.model.layers:
            if not layer.is_linear:
                continue
            m = layer.linear_attn
            s = m.shape
            kda = m.gate == "kda"
            core = RadixLinearAttention(
                layer.layer_id, s.num_k_heads, s.num_k_heads, s.num_v_heads, s.head_k_dim, s.head_k_dim,
                s.head_v_dim, conv_weights=m.conv_weight, bias=m.conv_bias, activation="silu",
                A_log=m.A_log.view(1, 1, -1, 1) if kda else m.A_log, dt_bias=m.dt_bias,
            )
            self.attn_cores[str(layer.layer_id)] = core

    def linear_gate_inputs(self, forward_batch, mixer: GatedDeltaRuleMixer, g_raw: torch.Tensor,
                           b_raw: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Raw gates shaped as SGLang's KDA backend takes them from Kimi-Linear
        (``srt/models/kimi_linear.py``, ``KimiDeltaAttention.forward``): ``a`` ``[1, T, HV, K]``
        in an extend, ``[T, HV*K]`` in a decode or target verify; ``b`` ``[1, T, HV]`` always.
        GDN: unchanged (``a`` ``[T, HV]``, ``b`` ``[T, HV]``, as Qwen3-Next hands them)."""
        if mixer.gate != "kda":
            return g_raw, b_raw
        mode = getattr(forward_batch, "logical_forward_mode", None) or forward_batch.forward_mode
        if not mode.is_decode() and not mode.is_target_verify():
            g_raw = g_raw.unflatten(-1, (mixer.shape.num_v_heads, mixer.shape.head_k_dim)).unsqueeze(0)
        return g_raw, b_raw.unsqueeze(0)

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> None:
        """:meth:`TinyHybridForCausalLM.load_weights`, then the KDA cores' ``A_log`` views
        ``[1, 1, HV, 1]`` are taken again from the loaded parameters."""
        super().load_weights(weights)
        for layer in self.model.layers:
            if layer.is_linear and layer.linear_attn.gate == "kda":
                self.attn_cores[str(layer.layer_id)].A_log = layer.linear_attn.A_log.view(1, 1, -1, 1)
