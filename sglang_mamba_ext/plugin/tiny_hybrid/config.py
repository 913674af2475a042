"""SGLang-facing config of the tiny hybrid model (``docs/design.md``, "Tiny hybrid model"):
:class:`TinyHybridSGLangConfig` adds the ``mamba2_cache_params`` SGLang sizes its Mamba pool
from (``srt/configs/hybrid_arch.py::mambaish_config``, ``mem_cache/memory_pool.py::MambaPool``):
per request and rank a conv row ``[conv_dim / tp, W-1]`` (window axis last) and a temporal row
``[HV / tp, V, K]``: SGLang's Gated DeltaNet layout, built by SGLang's own helper
(``Mamba2StateShape.create``, as ``configs/qwen3_next.py`` does), so the pool, PD transfer and
the deferred verify treat it as they treat Qwen3-Next. The backend reads it transposed into the
``[HV, K, V]`` of ``sglang_mamba_ext.models.linear_attn`` (fla's layout). Served by SGLang's KDA
backend (``architectures: ["TinyHybridKDAForCausalLM"]``) the pool is Kimi-Linear's instead
(``KimiLinearStateShape.create``, as ``configs/kimi_linear.py`` does): conv ``[W-1, conv_dim / tp]``
(window axis first) and temporal ``[HV / tp, V, V]`` (key and value heads and dims equal).
"""

from __future__ import annotations

from sglang.srt.configs.mamba_utils import (
    KimiLinearCacheParams,
    KimiLinearStateShape,
    Mamba2CacheParams,
    Mamba2StateShape,
    mamba2_state_dtype,
)
from sglang.srt.runtime_context import linear_attn_tp_size

from sglang_mamba_ext.models.tiny_hybrid import TinyHybridConfig
from sglang_mamba_ext.plugin.tiny_hybrid import KDA_SGLANG_ARCHITECTURE


class TinyHybridSGLangConfig(TinyHybridConfig):
    """:class:`TinyHybridConfig` plus the SSM pool description SGLang reads.

    ``mamba2_cache_params.dtype``: conv dtype from ``SGLANG_MAMBA_CONV_DTYPE`` (SGLang's
    default bf16; use ``float32`` for exact comparisons), temporal from
    ``SGLANG_MAMBA_SSM_DTYPE`` / ``mamba_ssm_dtype`` (default float32).

    ``mamba_chunk_size`` (tokens): the grid SGLang's extra_buffer tracking places prefill
    checkpoints on (``runtime_context.mamba_cache_chunk_size``; 64 = FLA's chunk for GPU
    kernels). The torch backend can stop at any token, so the tiny model uses a small grid:
    a prefill chunk that is a multiple of 8 tokens is checkpointed at its end. Served with
    SGLang's own GDN / KDA backends (``TinyHybridGDNForCausalLM`` / ``TinyHybridKDAForCausalLM``)
    it is their kernels' chunk, 64.
    """

    def __init__(self, **kwargs) -> None:
        # Spelled out: without an ``__init__`` of its own, transformers 5 builds one for the
        # subclass that skips :class:`TinyHybridConfig`'s defaults (``hidden_size`` etc.
        # were missing from ``TinyHybridSGLangConfig()``; ``from_pretrained`` was unaffected).
        super().__init__(**kwargs)

    @property
    def mamba_chunk_size(self) -> int:
        from sglang_mamba_ext.plugin.tiny_hybrid import SGLANG_KERNEL_ARCHITECTURES

        archs = getattr(self, "architectures", None) or []
        return 64 if any(a in SGLANG_KERNEL_ARCHITECTURES for a in archs) else 8

    @property
    def serves_with_sglang_kda(self) -> bool:
        """Whether the config names ``TinyHybridKDAForCausalLM`` (SGLang's ``KDAAttnBackend``)."""
        return KDA_SGLANG_ARCHITECTURE in (getattr(self, "architectures", None) or [])

    @property
    def mamba2_cache_params(self):
        """Per-rank pool description (``linear_attn_tp_size()`` ranks share the heads;
        ``conv_shard_groups``: the q, k, v blocks of ``mixed_qkv``, each sharded by heads):
        ``Mamba2CacheParams`` (GDN layout), or ``KimiLinearCacheParams`` when
        :attr:`serves_with_sglang_kda`.

        Raises:
            ValueError: the KDA architecture with linear key and value heads or head dims
                that differ (Kimi-Linear's pool has one of each; rebuild the model with
                ``scripts/make_tiny_model.py --linear-gate kda --linear-kernels sglang``)."""
        s = self.linear_attn_shape
        if self.serves_with_sglang_kda:
            if s.num_k_heads != s.num_v_heads or s.head_k_dim != s.head_v_dim:
                raise ValueError(
                    f"{KDA_SGLANG_ARCHITECTURE}: SGLang's KDA pool needs linear_num_key_heads == "
                    f"linear_num_value_heads and linear_key_head_dim == linear_value_head_dim, got "
                    f"{s.num_k_heads}/{s.num_v_heads} heads and {s.head_k_dim}/{s.head_v_dim} dims "
                    "(rebuild with scripts/make_tiny_model.py --linear-gate kda --linear-kernels sglang)"
                )
            shape = KimiLinearStateShape.create(
                tp_world_size=linear_attn_tp_size(),
                num_heads=s.num_v_heads,
                head_dim=s.head_v_dim,
                num_k_heads=s.num_k_heads,
                head_k_dim=s.head_k_dim,
                conv_kernel_size=s.conv_kernel,
            )
            return KimiLinearCacheParams(
                shape=shape, layers=self.linear_layer_ids, dtype=mamba2_state_dtype(self)
            )
        shape = Mamba2StateShape.create(
            tp_world_size=linear_attn_tp_size(),
            intermediate_size=s.value_dim,
            n_groups=s.num_k_heads,
            num_heads=s.num_v_heads,
            head_dim=s.head_v_dim,
            state_size=s.head_k_dim,
            conv_kernel=s.conv_kernel,
            conv_shard_groups=[s.key_dim, s.key_dim, s.value_dim],
        )
        return Mamba2CacheParams(
            shape=shape, layers=self.linear_layer_ids, dtype=mamba2_state_dtype(self)
        )
