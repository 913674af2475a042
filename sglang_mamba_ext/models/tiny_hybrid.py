"""Tiny hybrid reference model (full attention + gated-delta-rule layers), plain torch: the
project's numerical oracle (``docs/design.md``, "Tiny hybrid model"). A small decoder whose
layers alternate causal softmax attention with RoPE (GQA) and the KDA-style mixer of
:mod:`sglang_mamba_ext.models.linear_attn`, each followed by a SwiGLU MLP, with RMSNorm and an
LM head; it loads the ``config.json`` + ``model.safetensors`` of ``scripts/make_tiny_model.py``,
and the SGLang model class (``plugin/tiny_hybrid/model.py``) builds its layers from these very
modules, so both run one implementation of all the math but the softmax attention kernel. The
state of one sequence (:class:`TinyHybridCache`) is what SGLang's pools hold per request: per
attention layer the K/V so far, per linear layer the conv window ``[conv_dim, W-1]`` and the
SSM state ``[HV, K, V]`` float32. Callers that schedule layers themselves (the tree-shaped
verify of the reference decode loop) compose ``model.embed``, per layer
``input_layernorm`` then ``self_attn.project_qkv`` -> :func:`attention` (any boolean mask) ->
``self_attn.finish`` or the mixer steps, ``h + mixer_out`` and ``layer.mlp_block``, and
``model.logits``. No sglang import; transformers only for the config class.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from sglang_mamba_ext.models.linear_attn import GATES, GatedDeltaRuleMixer, LinearAttnShape, rms_norm

__all__ = [
    "FULL_ATTENTION",
    "LINEAR_ATTENTION",
    "TinyHybridConfig",
    "TinyHybridCache",
    "RMSNorm",
    "SwiGLUMLP",
    "FullAttention",
    "TinyHybridDecoderLayer",
    "TinyHybridModel",
    "TinyHybridReference",
    "apply_rope",
    "attention",
    "causal_mask",
]

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"
MODEL_TYPE = "tiny_hybrid"
ARCHITECTURE = "TinyHybridForCausalLM"


class TinyHybridConfig(PretrainedConfig):
    """Configuration of the tiny hybrid model (``model_type = "tiny_hybrid"``).

    Layer layout is ``layer_types``: one of ``"full_attention"`` / ``"linear_attention"`` per
    layer. Attention: ``num_attention_heads`` query heads and ``num_key_value_heads`` K/V
    heads of ``head_dim``, RoPE with ``rope_theta``. Linear layers:
    ``linear_num_key_heads`` (H), ``linear_num_value_heads`` (HV), ``linear_key_head_dim``
    (K), ``linear_value_head_dim`` (V), ``linear_conv_kernel_dim`` (W),
    ``linear_gate_rank`` (rank of the low-rank decay gate), ``linear_gate`` (``"kda"``: a
    decay per key channel, Kimi-Linear's KDA; ``"gdn"``: one per value head, Qwen3-Next's
    Gated DeltaNet; :data:`~sglang_mamba_ext.models.linear_attn.GATES`).

    Raises:
        ValueError: an unknown layer type, or head counts that do not divide.
    """

    model_type = MODEL_TYPE

    def __init__(
        self,
        vocab_size: int = 512,
        hidden_size: int = 64,
        intermediate_size: int = 128,
        num_hidden_layers: int = 4,
        layer_types: Optional[List[str]] = None,
        num_attention_heads: int = 4,
        num_key_value_heads: int = 2,
        head_dim: int = 16,
        rope_theta: float = 10000.0,
        max_position_embeddings: int = 4096,
        rms_norm_eps: float = 1e-6,
        linear_num_key_heads: int = 2,
        linear_num_value_heads: int = 4,
        linear_key_head_dim: int = 16,
        linear_value_head_dim: int = 32,
        linear_conv_kernel_dim: int = 4,
        linear_gate_rank: int = 16,
        linear_gate: str = "kda",
        tie_word_embeddings: bool = False,
        **kwargs,
    ) -> None:
        layer_types = _checked_layout(layer_types, num_hidden_layers, num_attention_heads, num_key_value_heads)
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.layer_types = layer_types
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim
        self.rope_theta = rope_theta
        self.max_position_embeddings = max_position_embeddings
        self.rms_norm_eps = rms_norm_eps
        self.linear_num_key_heads = linear_num_key_heads
        self.linear_num_value_heads = linear_num_value_heads
        self.linear_key_head_dim = linear_key_head_dim
        self.linear_value_head_dim = linear_value_head_dim
        self.linear_conv_kernel_dim = linear_conv_kernel_dim
        self.linear_gate_rank = linear_gate_rank
        if linear_gate not in GATES:
            raise ValueError(f"TinyHybridConfig: linear_gate must be one of {GATES}, got {linear_gate!r}")
        self.linear_gate = linear_gate
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)

    @property
    def linear_layer_ids(self) -> List[int]:
        """Indices of the linear-attention layers (SGLang's name)."""
        return [i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION]

    @property
    def full_attention_layer_ids(self) -> List[int]:
        """Indices of the full-attention layers (SGLang's name)."""
        return [i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION]

    @property
    def linear_attn_shape(self) -> LinearAttnShape:
        """Head layout of every linear layer."""
        return LinearAttnShape(
            num_k_heads=self.linear_num_key_heads,
            num_v_heads=self.linear_num_value_heads,
            head_k_dim=self.linear_key_head_dim,
            head_v_dim=self.linear_value_head_dim,
            conv_kernel=self.linear_conv_kernel_dim,
        )


def _checked_layout(
    layer_types: Optional[List[str]], num_hidden_layers: int, num_attention_heads: int, num_key_value_heads: int
) -> List[str]:
    """``layer_types`` as a list (default: attention on even layers, linear on odd ones).

    Raises:
        ValueError: a wrong number of layer types, an unknown type, or query heads that are
            not a multiple of the K/V heads."""
    if layer_types is None:
        layer_types = [FULL_ATTENTION if i % 2 == 0 else LINEAR_ATTENTION for i in range(num_hidden_layers)]
    layer_types = list(layer_types)
    if len(layer_types) != num_hidden_layers:
        raise ValueError(
            f"config.json: layer_types has {len(layer_types)} entries, num_hidden_layers is "
            f"{num_hidden_layers}"
        )
    for t in layer_types:
        if t not in (FULL_ATTENTION, LINEAR_ATTENTION):
            raise ValueError(
                f"config.json: unknown layer type {t!r} in layer_types; use "
                f"{FULL_ATTENTION!r} or {LINEAR_ATTENTION!r}"
            )
    if num_attention_heads % num_key_value_heads != 0:
        raise ValueError("config.json: num_attention_heads must be a multiple of num_key_value_heads")
    return layer_types


def _register_auto_config() -> None:
    """Let ``AutoConfig`` / ``AutoTokenizer`` recognise ``model_type: tiny_hybrid`` (silences
    transformers' unknown-model warning). The SGLang plugin later re-registers the subclass
    that adds ``mamba2_cache_params``; an existing registration is kept."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if MODEL_TYPE not in CONFIG_MAPPING:
        AutoConfig.register(MODEL_TYPE, TinyHybridConfig)


_register_auto_config()


# ---------------------------------------------------------------------------------------
# Shared layer math (the SGLang model builds its layers from these classes)
# ---------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """RMSNorm over the last dim with a learned ``weight`` ``[dim]``
    (:func:`~sglang_mamba_ext.models.linear_attn.rms_norm`)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class SwiGLUMLP(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))``; ``[T, hidden] -> [T, hidden]``."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding, NeoX (rotate-half) layout, computed in float32.

    Args:
        x: ``[T, n_heads, D]`` (``D`` even).
        positions: ``[T]`` integer token positions (0-based, tokens).
        theta: RoPE base.

    Returns:
        ``[T, n_heads, D]`` in ``x.dtype``.
    """
    D = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.float32, device=x.device) / D))
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    cos, sin = freqs.cos()[:, None, :], freqs.sin()[:, None, :]
    xf = x.float()
    x1, x2 = xf[..., : D // 2], xf[..., D // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def causal_mask(num_new: int, num_past: int, device=None) -> torch.Tensor:
    """Boolean ``[num_new, num_past + num_new]`` mask: new token ``i`` sees all past tokens
    and new tokens ``<= i``."""
    cols = torch.arange(num_past + num_new, device=device)
    rows = torch.arange(num_new, device=device) + num_past
    return cols[None, :] <= rows[:, None]


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """Softmax attention with grouped K/V heads and an arbitrary boolean mask.

    Args:
        q: ``[T, NH, D]`` queries; k, v: ``[S, NKV, D]`` keys/values (NH multiple of NKV).
        mask: ``[T, S]`` bool, True where query ``t`` may attend key ``s`` (causal, or a
            tree mask over prefix + draft nodes). Every row needs at least one True.
        scale: default ``D ** -0.5``.

    Returns:
        ``[T, NH, D]`` in ``q.dtype`` (softmax in float32).
    """
    NH, D = q.shape[1], q.shape[2]
    G = NH // k.shape[1]
    if scale is None:
        scale = D**-0.5
    kf = k.float().repeat_interleave(G, dim=1)
    vf = v.float().repeat_interleave(G, dim=1)
    scores = torch.einsum("thd,shd->hts", q.float() * scale, kf)
    scores = scores.masked_fill(~mask[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hts,shd->thd", probs, vf).to(q.dtype)


class FullAttention(nn.Module):
    """Projections of a GQA softmax-attention layer with RoPE.

    ``q_proj`` ``[NH*D, hidden]``, ``k_proj``/``v_proj`` ``[NKV*D, hidden]``, ``o_proj``
    ``[hidden, NH*D]``, no biases.
    """

    def __init__(self, config: TinyHybridConfig) -> None:
        super().__init__()
        c = config
        self.num_heads = c.num_attention_heads
        self.num_kv_heads = c.num_key_value_heads
        self.head_dim = c.head_dim
        self.rope_theta = c.rope_theta
        self.scaling = c.head_dim**-0.5
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)

    def project_qkv(
        self, x: torch.Tensor, positions: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x`` ``[T, hidden]``, ``positions`` ``[T]`` -> ``q`` ``[T, NH, D]``, ``k``
        ``[T, NKV, D]`` (both rotated), ``v`` ``[T, NKV, D]``."""
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)
        return apply_rope(q, positions, self.rope_theta), apply_rope(k, positions, self.rope_theta), v

    def finish(self, o: torch.Tensor) -> torch.Tensor:
        """``o`` ``[T, NH, D]`` (or ``[T, NH*D]``) -> ``o_proj`` ``[T, hidden]``."""
        return self.o_proj(o.reshape(o.shape[0], self.num_heads * self.head_dim))

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        past_k: Optional[torch.Tensor] = None,
        past_v: Optional[torch.Tensor] = None,
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Causal attention of new tokens over past + new K/V.

        Returns ``(y [T, hidden], k_all [S+T, NKV, D], v_all [S+T, NKV, D])``."""
        q, k, v = self.project_qkv(x, positions)
        if past_k is not None:
            k = torch.cat([past_k, k], dim=0)
            v = torch.cat([past_v, v], dim=0)
        mask = causal_mask(x.shape[0], k.shape[0] - x.shape[0], device=x.device)
        o = attention(q, k, v, mask, self.scaling)
        return self.finish(o), k, v


class TinyHybridDecoderLayer(nn.Module):
    """``h += mixer(input_layernorm(h)); h += mlp(post_attention_layernorm(h))``.

    The mixer is ``self_attn`` (:class:`FullAttention`) or ``linear_attn``
    (:class:`~sglang_mamba_ext.models.linear_attn.GatedDeltaRuleMixer`) by
    ``config.layer_types[layer_id]``.
    """

    def __init__(self, config: TinyHybridConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.layer_type = config.layer_types[layer_id]
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if self.layer_type == FULL_ATTENTION:
            self.self_attn = FullAttention(config)
        else:
            self.linear_attn = GatedDeltaRuleMixer(
                config.hidden_size,
                config.linear_attn_shape,
                gate_low_rank_dim=config.linear_gate_rank,
                norm_eps=config.rms_norm_eps,
                gate=getattr(config, "linear_gate", "kda"),
            )
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLUMLP(config.hidden_size, config.intermediate_size)

    @property
    def is_linear(self) -> bool:
        return self.layer_type == LINEAR_ATTENTION

    def mlp_block(self, h: torch.Tensor) -> torch.Tensor:
        """Second half of the layer: ``h + mlp(post_attention_layernorm(h))``."""
        return h + self.mlp(self.post_attention_layernorm(h))


@dataclass
class TinyHybridCache:
    """All state of one sequence after ``seq_len`` tokens.

    Attributes:
        seq_len: tokens consumed so far.
        kv: attention layer id -> ``(k, v)`` each ``[seq_len, NKV, D]`` (RoPE applied to k).
        conv: linear layer id -> conv window ``[conv_dim, W-1]``.
        temporal: linear layer id -> SSM state ``[HV, K, V]`` float32.
    """

    seq_len: int = 0
    kv: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    conv: Dict[int, torch.Tensor] = field(default_factory=dict)
    temporal: Dict[int, torch.Tensor] = field(default_factory=dict)

    def clone(self) -> "TinyHybridCache":
        return TinyHybridCache(
            seq_len=self.seq_len,
            kv={i: (k.clone(), v.clone()) for i, (k, v) in self.kv.items()},
            conv={i: c.clone() for i, c in self.conv.items()},
            temporal={i: s.clone() for i, s in self.temporal.items()},
        )


class TinyHybridModel(nn.Module):
    """Decoder body: ``embed_tokens``, ``layers``, final ``norm`` (no LM head)."""

    def __init__(self, config: TinyHybridConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [TinyHybridDecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class TinyHybridReference(nn.Module):
    """Standalone torch model; parameter names equal the safetensors keys
    (``model.embed_tokens.weight``, ``model.layers.{i}.…``, ``model.norm.weight``,
    ``lm_head.weight`` unless tied)."""

    def __init__(self, config: TinyHybridConfig) -> None:
        super().__init__()
        self.config = config
        self.model = TinyHybridModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    # -- loading -------------------------------------------------------------------------

    @classmethod
    def from_pretrained(
        cls, model_dir: Union[str, os.PathLike], dtype: torch.dtype = torch.float32
    ) -> "TinyHybridReference":
        """Load ``config.json`` + ``model.safetensors`` from ``model_dir``.

        Raises:
            FileNotFoundError: a file is missing (build one with
                ``python scripts/make_tiny_model.py --out DIR``).
            RuntimeError: the checkpoint's tensors do not match the config.
        """
        from safetensors.torch import load_file

        model_dir = os.fspath(model_dir)
        for name in ("config.json", "model.safetensors"):
            if not os.path.isfile(os.path.join(model_dir, name)):
                raise FileNotFoundError(
                    f"{os.path.join(model_dir, name)} not found; build a tiny model with "
                    "`python scripts/make_tiny_model.py --out DIR`"
                )
        config = TinyHybridConfig.from_pretrained(model_dir)
        model = cls(config)
        state = load_file(os.path.join(model_dir, "model.safetensors"))
        if config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [m for m in missing if not (config.tie_word_embeddings and m == "lm_head.weight")]
        if missing or unexpected:
            raise RuntimeError(
                f"{model_dir}/model.safetensors does not match config.json: missing {missing}, "
                f"unexpected {unexpected}"
            )
        return model.to(dtype).eval()

    # -- building blocks -----------------------------------------------------------------

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.layers

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` token ids -> ``[T, hidden]``."""
        return self.model.embed_tokens(input_ids)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head: ``[T, hidden]`` -> ``[T, vocab]`` float32."""
        return self.lm_head(self.model.norm(h)).float()

    # -- whole-model forward -------------------------------------------------------------

    @torch.no_grad()
    def forward_tokens(
        self,
        token_ids: Union[Sequence[int], torch.Tensor],
        cache: Optional[TinyHybridCache] = None,
        return_hidden: bool = False,
        save_states_at: Sequence[int] = (),
    ):
        """Run ``T`` new tokens of one sequence after ``cache`` (None = empty prefix).

        Args:
            token_ids: ``[T]`` ints (T >= 1).
            cache: the sequence's state; not modified.
            save_states_at: sequence positions ``p`` (tokens, ``cache.seq_len < p <=
                cache.seq_len + T``) at which to also return the linear layers' states
                after token ``p - 1`` — a checkpoint inside the chunk: the mixer's
                ``run_segments`` cuts the chunk at those positions, which is the same
                recurrence.

        Returns:
            ``(logits [T, vocab] float32, new_cache)`` — plus ``hidden [T, hidden]`` (the
            last layer's output, before the final norm) when ``return_hidden``, plus
            ``{p: TinyHybridCache(seq_len=p, conv, temporal)}`` (no KV) when
            ``save_states_at`` is given.

        Raises:
            ValueError: on an empty token list or a save position outside the chunk.
        """
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.lm_head.weight.device).reshape(-1)
        if ids.numel() == 0:
            raise ValueError("forward_tokens: empty token list")
        cache = cache if cache is not None else TinyHybridCache()
        T = ids.numel()
        start = cache.seq_len
        cuts = sorted(set(int(p) for p in save_states_at))
        if cuts and not (start < cuts[0] and cuts[-1] <= start + T):
            raise ValueError(f"save_states_at {cuts} outside the chunk ({start}, {start + T}]")
        saved = {p: TinyHybridCache(seq_len=p) for p in cuts}
        positions = torch.arange(start, start + T, device=ids.device)
        new = TinyHybridCache(seq_len=start + T)
        h = self.embed(ids)
        for layer in self.layers:
            x = layer.input_layernorm(h)
            i = layer.layer_id
            if layer.is_linear:

                def save(offset: int, conv: torch.Tensor, temporal: torch.Tensor, i: int = i) -> None:
                    saved[start + offset].conv[i], saved[start + offset].temporal[i] = conv, temporal

                y, new.conv[i], new.temporal[i] = layer.linear_attn(
                    x, cache.conv.get(i), cache.temporal.get(i), cuts=[p - start for p in cuts], on_cut=save
                )
            else:
                past_k, past_v = cache.kv.get(i, (None, None))
                y, k_all, v_all = layer.self_attn(x, positions, past_k, past_v)
                new.kv[i] = (k_all, v_all)
            h = layer.mlp_block(h + y)
        logits = self.logits(h)
        out = (logits, new, h) if return_hidden else (logits, new)
        return out + (saved,) if cuts else out

    def prefill(
        self, token_ids: Union[Sequence[int], torch.Tensor], cache: Optional[TinyHybridCache] = None
    ) -> Tuple[torch.Tensor, TinyHybridCache]:
        """Prefill (or extend) from optional cached state: ``(logits [T, vocab], cache)``."""
        return self.forward_tokens(token_ids, cache)

    def decode_step(self, token_id: int, cache: TinyHybridCache) -> Tuple[torch.Tensor, TinyHybridCache]:
        """One decode token: ``(logits [vocab] float32, new_cache)``."""
        logits, new = self.forward_tokens([int(token_id)], cache)
        return logits[0], new

    @torch.no_grad()
    def generate_greedy(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        cache: Optional[TinyHybridCache] = None,
        eos_token_id: Optional[int] = None,
    ) -> List[int]:
        """Greedy (argmax, lowest id on ties) continuation of ``prompt_ids`` after
        ``cache``; stops after ``max_new_tokens`` or at ``eos_token_id`` (included)."""
        logits, cache = self.prefill(prompt_ids, cache)
        out: List[int] = []
        nxt = int(torch.argmax(logits[-1]))
        while True:
            out.append(nxt)
            if len(out) >= max_new_tokens or (eos_token_id is not None and nxt == eos_token_id):
                return out
            step_logits, cache = self.decode_step(nxt, cache)
            nxt = int(torch.argmax(step_logits))
