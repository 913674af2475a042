"""SGLang-facing config of the tiny hybrid model (``docs/design.md``, "Tiny hybrid model"):
:class:`TinyHybridSGLangConfig` adds the ``mamba2_cache_params`` SGLang sizes its Mamba pool
from (``srt/configs/hybrid_arch.py::mambaish_config``, ``mem_cache/memory_pool.py::MambaPool``):
per request a conv row ``[conv_dim, W-1]`` (window axis last) and a temporal row ``[HV, K, V]``,
the layout of ``sglang_mamba_ext.models.linear_attn`` (fla's), not the ``[HV, V, K]`` of
SGLang's GDN kernels. One rank (no tensor parallelism).
"""

from __future__ import annotations

from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape, mamba2_state_dtype

from sglang_mamba_ext.models.tiny_hybrid import TinyHybridConfig


class TinyHybridSGLangConfig(TinyHybridConfig):
    """:class:`TinyHybridConfig` plus the SSM pool description SGLang reads.

    ``mamba2_cache_params.dtype``: conv dtype from ``SGLANG_MAMBA_CONV_DTYPE`` (SGLang's
    default bf16; use ``float32`` for exact comparisons), temporal from
    ``SGLANG_MAMBA_SSM_DTYPE`` / ``mamba_ssm_dtype`` (default float32).

    ``mamba_chunk_size`` (tokens): the grid SGLang's extra_buffer tracking places prefill
    checkpoints on (``runtime_context.mamba_cache_chunk_size``; 64 = FLA's chunk for GPU
    kernels). The torch backend can stop at any token, so the tiny model uses a small grid:
    a prefill chunk that is a multiple of 8 tokens is checkpointed at its end.
    """

    mamba_chunk_size = 8

    @property
    def mamba2_cache_params(self) -> Mamba2CacheParams:
        s = self.linear_attn_shape
        shape = Mamba2StateShape(
            conv=[s.conv_state_shape],
            temporal=s.temporal_state_shape,
            intermediate_size=s.value_dim,
            conv_dim=s.conv_dim,
            ssm_state_size=s.head_k_dim,
            num_heads=s.num_v_heads,
            head_dim=s.head_v_dim,
            state_size=s.head_k_dim,
            conv_kernel=s.conv_kernel,
            num_k_heads_per_tp=s.num_k_heads,
            conv_shard_groups=[s.key_dim, s.key_dim, s.value_dim],
        )
        return Mamba2CacheParams(
            shape=shape, layers=self.linear_layer_ids, dtype=mamba2_state_dtype(self)
        )
