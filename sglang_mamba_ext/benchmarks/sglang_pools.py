"""SGLang's own memory-pool sizing and construction for a hybrid model, in-process on CPU with
the device memory query simulated and the pool tensors on the ``meta`` device (no bytes
allocated, shapes and dtypes exact) — what a target worker's ``ModelRunner`` runs at start-up
(``KVCacheConfigurator.configure``: ``_resolve_memory_pool_config`` (``_profile_available_bytes``
-> ``_handle_max_mamba_cache`` -> ``config_from_budget`` -> ``resolve_max_num_reqs``), then
``_build_req_to_token_pool``: the ``HybridReqToTokenPool`` and its ``MambaPool``), with the
plugin's hooks applied as ``load_plugins`` applies them. The KV pool itself is not built
(SGLang's MHA pool asks the device for a stream module, which ``meta`` lacks); its size is
SGLang's resolved ``max_total_num_tokens``. Used by
``scripts/plan_spec_memory.py`` and ``tests/test_spec_budget.py``.

The model is given by its published ``config.json`` fields that SGLang's sizing reads
(:data:`PUBLISHED`); no weights are loaded. The memory SGLang finds is stated, not measured:
``total_gib`` is the free device memory before the weights load (``pre_model_load_memory``),
``free_gib`` the free memory after (``get_available_gpu_memory``); SGLang keeps
``total_gib * (1 - mem_fraction_static)`` of it for activations and splits the rest between the
Mamba pool and the KV pool. Tensor parallelism is simulated by the runtime context's
``attn_tp_size`` (per-rank head counts), one rank.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import tempfile
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Dict, List, Optional, Sequence
from unittest import mock

__all__ = ["PUBLISHED", "PublishedModel", "PoolResult", "model_dir", "size_pools"]


@dataclass(frozen=True)
class PublishedModel:
    """A model's ``config.json`` fields that SGLang's pool sizing reads, with their source."""

    name: str
    source: str
    config: Dict
    params_b: float  # nominal total parameters (billions), for the weight bytes of a stated budget


PUBLISHED: Dict[str, PublishedModel] = {m.name: m for m in (
    PublishedModel(
        "Kimi-Linear-48B-A3B",
        "https://huggingface.co/moonshotai/Kimi-Linear-48B-A3B-Instruct/blob/main/config.json "
        "(model card: 48B total / 3B activated parameters): MLA full attention on layers "
        "[4,8,12,16,20,24,27] (kv_lora_rank 512, qk_rope_head_dim 64), KDA on the other 20 of 27 "
        "layers (32 heads x 128, short conv 4)",
        {
            "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear",
            "vocab_size": 163840, "hidden_size": 2304, "intermediate_size": 9216, "moe_intermediate_size": 1024,
            "num_hidden_layers": 27, "num_attention_heads": 32, "num_key_value_heads": 32,
            "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
            "v_head_dim": 128, "mla_use_nope": True, "num_experts": 256, "num_experts_per_token": 8,
            "num_shared_experts": 1, "first_k_dense_replace": 1, "moe_layer_freq": 1,
            "model_max_length": 1048576, "torch_dtype": "bfloat16",
            "linear_attn_config": {
                "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
                "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
                "num_heads": 32, "head_dim": 128, "short_conv_kernel_size": 4,
            },
        },
        48.0,
    ),
    PublishedModel(
        "Qwen3-Next-80B-A3B",
        "https://huggingface.co/Qwen/Qwen3-Next-80B-A3B-Instruct/blob/main/config.json "
        "(80B total / 3B activated): 48 layers, full_attention_interval 4 (12 gated-attention "
        "layers: 16 q heads, 2 KV heads x 256), 36 Gated DeltaNet layers (16 key heads, 32 value "
        "heads, 128 x 128, conv 4)",
        {
            "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
            "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5120, "num_hidden_layers": 48,
            "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "full_attention_interval": 4,
            "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
            "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 512,
            "num_experts_per_tok": 10, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
            "decoder_sparse_step": 1, "norm_topk_prob": True, "partial_rotary_factor": 0.25,
            "rope_theta": 10000000, "max_position_embeddings": 262144, "torch_dtype": "bfloat16",
        },
        80.0,
    ),
    PublishedModel(
        "Qwen3.5-27B",
        "https://huggingface.co/Qwen/Qwen3.5-27B/blob/main/config.json, its text_config (27B dense; "
        "published as Qwen3_5ForConditionalGeneration, sized here as the text model "
        "Qwen3_5ForCausalLM, whose pools are the same): 64 layers, full_attention_interval 4 "
        "(16 gated-attention layers: 24 q heads, 4 KV heads x 256), 48 Gated DeltaNet layers "
        "(16 key heads, 48 value heads, 128 x 128, conv 4), one MTP layer",
        {
            "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
            "vocab_size": 248320, "hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 64,
            "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256, "full_attention_interval": 4,
            "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
            "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "attn_output_gate": True,
            "partial_rotary_factor": 0.25, "rope_theta": 10000000, "max_position_embeddings": 262144,
            "rms_norm_eps": 1e-6, "mtp_num_hidden_layers": 1, "torch_dtype": "bfloat16",
        },
        27.0,
    ),
    PublishedModel(
        "Nemotron-Nano-9B-v2",
        "https://huggingface.co/nvidia/NVIDIA-Nemotron-Nano-9B-v2/blob/main/config.json "
        "(NemotronHForCausalLM, 9B): 56 layers by hybrid_override_pattern, 27 Mamba2 layers "
        "(128 heads x 80, 8 groups, state 128, conv 4), 4 attention layers (40 q heads, 8 KV heads "
        "x 128), 25 MLP layers",
        {
            "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
            "vocab_size": 131072, "hidden_size": 4480, "intermediate_size": 15680, "num_hidden_layers": 56,
            "hybrid_override_pattern": "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-",
            "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128,
            "mamba_num_heads": 128, "mamba_head_dim": 80, "n_groups": 8, "ssm_state_size": 128,
            "conv_kernel": 4, "expand": 2, "use_conv_bias": True, "chunk_size": 128,
            "mlp_hidden_act": "relu2", "max_position_embeddings": 131072, "torch_dtype": "bfloat16",
        },
        9.0,
    ),
)}

_DIRS: Dict[str, str] = {}


def model_dir(name: str) -> str:
    """A directory holding ``config.json`` of :data:`PUBLISHED` ``[name]`` (written once per
    process)."""
    if name not in _DIRS:
        d = tempfile.mkdtemp(prefix="sgl-mamba-ext-" + name.lower() + "-")
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(PUBLISHED[name].config, f)
        _DIRS[name] = d
    return _DIRS[name]


@dataclass
class PoolResult:
    """What SGLang resolved and built for one configuration.

    Attributes:
        mode: ``--mamba-spec-state-update`` value given (``None``: flag absent).
        max_total_num_tokens: KV pool tokens.
        max_running_requests: SGLang's resolved ``max_running_requests``.
        max_mamba_cache_size: Mamba pool slots (``MambaPool.size``).
        mamba_ratio: SGLang's Mamba slots per request (``_calculate_mamba_ratio``).
        slot_bytes: one Mamba slot's conv + SSM bytes over the rank's linear layers
            (``mamba_cache_per_req``).
        rest_bytes: bytes SGLang split between the Mamba and KV pools (after the activation
            reserve), from the simulated memory.
        kv_budget_bytes: bytes SGLang handed to the KV pool sizing (``config_from_budget``).
        kv_cell_bytes: KV bytes per token.
        spec: bytes of the speculative buffers the Mamba pool holds, by component
            (snapshot: ``intermediate_ssm`` / ``intermediate_conv_window``; deferred: the
            ``DeferredSpecState.nbytes()`` components).
        rows: request rows of those buffers (``spec_state_size + 1``).
        refused: the error text when SGLang or the plugin refused the configuration.
    """

    mode: Optional[str]
    max_total_num_tokens: int = 0
    max_running_requests: int = 0
    max_mamba_cache_size: int = 0
    mamba_ratio: int = 0
    slot_bytes: int = 0
    rest_bytes: int = 0
    kv_budget_bytes: int = 0
    kv_cell_bytes: int = 0
    spec: Dict[str, int] = field(default_factory=dict)
    rows: int = 0
    refused: Optional[str] = None
    verify: Optional[str] = None  # the deferred verify variant the glue built ("on_chip" / "one_layer")

    @property
    def spec_bytes(self) -> int:
        return sum(self.spec.values())


def _nbytes(t) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _spec_buffers(pool):
    """``(bytes by component, rows)`` of the pool's speculative buffers."""
    from sglang_mamba_ext.plugin.speculative import hooks

    state = getattr(pool, hooks.POOL_ATTR, None)
    if state is not None:
        return dict(state.nbytes()), state.num_rows
    mc = pool.mamba_cache
    ssm = getattr(mc, "intermediate_ssm", None)
    phys = getattr(pool, "_intermediate_conv_window_phys", None) or []
    conv = sum(_nbytes(t) for t in phys) if phys else sum(_nbytes(t) for t in getattr(mc, "intermediate_conv_window", []) or [])
    return ({"intermediate_ssm": _nbytes(ssm), "intermediate_conv_window": conv},
            0 if ssm is None else ssm.shape[1])


def size_pools(name: str, mode: Optional[str], *, total_gib: float, free_gib: float, tp: int = 1, topk: int = 4,
               steps: int = 3, draft_tokens: int = 63, mem_fraction_static: float = 0.88,
               ssm_dtype: str = "bfloat16", conv_dtype: str = "bfloat16", context_length: int = 32768,
               extra_argv: Sequence[str] = (), verify: str = "auto") -> PoolResult:
    """Run SGLang's ``KVCacheConfigurator.configure`` for a target worker of :data:`PUBLISHED`
    ``[name]`` under ``--speculative-algorithm FROZEN_KV_MTP --speculative-eagle-topk topk
    --speculative-num-steps steps --speculative-num-draft-tokens draft_tokens
    --disable-overlap-schedule`` (plus ``--mamba-spec-state-update mode`` unless ``None``, and
    ``extra_argv``), with ``SGLANG_MAMBA_SSM_DTYPE=ssm_dtype`` and ``SGLANG_MAMBA_CONV_DTYPE=conv_dtype``
    for that call only (whatever the process environment says, e.g. the plugin's CPU defaults'
    float32 conv windows); KV in bf16. A refusal (the plugin's start-up errors, SGLang's "not enough memory")
    comes back as :attr:`PoolResult.refused`. ``verify``: ``SGLANG_MAMBA_EXT_DEFERRED_VERIFY`` for
    the call (``auto``: the glue's on-chip rule, ``speculative/verify_onchip.py``; ``one_layer`` /
    ``on_chip`` force a variant)."""
    import torch

    from sglang_mamba_ext.benchmarks.scheduler import apply_plugin
    from sglang_mamba_ext.plugin.startup_errors import FlagError

    apply_plugin()
    from sglang.srt.configs.model_config import AttentionArch, ModelConfig
    from sglang.srt.mem_cache import kv_cache_configurator as kvc_mod
    from sglang.srt.model_executor.model_runner_components.layer_setup import ModelLayerInfo
    from sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state import SpecAuxHiddenStateConfig
    from sglang.srt.model_executor.pool_configurator import create_memory_pool_configurator
    from sglang.srt.runtime_context import create_context, get_parallel, use_context
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    argv: List[str] = [
        "--model-path", model_dir(name), "--device", "cpu", "--trust-remote-code",
        "--context-length", str(context_length), "--mem-fraction-static", str(mem_fraction_static),
        "--speculative-algorithm", "FROZEN_KV_MTP", "--speculative-num-steps", str(steps),
        "--speculative-eagle-topk", str(topk), "--speculative-num-draft-tokens", str(draft_tokens),
        "--disable-overlap-schedule", *extra_argv,
    ]
    if mode is not None:
        argv += ["--mamba-spec-state-update", mode]
    from sglang_mamba_ext.plugin.speculative import hooks

    res = PoolResult(mode)
    # the deferred glue remembers the target's backend layout process-wide (one target per
    # server process); start from none and leave the caller's value as it was
    from sglang_mamba_ext.speculative.verify_onchip import VERIFY_ENV

    env = {"SGLANG_MAMBA_SSM_DTYPE": ssm_dtype, "SGLANG_MAMBA_CONV_DTYPE": conv_dtype, VERIFY_ENV: verify}
    with mock.patch.dict(os.environ, env), \
            mock.patch.object(hooks, "_target_layout", None):
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                parsed = prepare_server_args(argv)
        except (FlagError, SystemExit) as e:
            # the plugin's start-up checks (e.g. deferred mode on a Mamba2 target) end in
            # argparse's usage + "error:" lines; keep the error line as the refusal
            lines = [ln for ln in err.getvalue().splitlines() if "error:" in ln]
            res.refused = lines[-1].split("error:", 1)[1].strip() if lines else f"{type(e).__name__}: {e}"
            return res
        sa = pickle.loads(pickle.dumps(parsed))  # as a scheduler process receives it
        ctx = create_context(sa, role="scheduler")
        with use_context(ctx), get_parallel().override(
                world_group=SimpleNamespace(cpu_group=None), tp_size=tp, attn_tp_size=tp, moe_tp_size=tp):
            mc = ModelConfig.from_server_args(sa)
            n = mc.hf_config.num_hidden_layers
            conf = kvc_mod.KVCacheConfigurator(
                device="meta", gpu_id=0, attn_dp_size=1, pp_size=1, pp_group=None, model=None, model_config=mc,
                server_args=sa, kv_cache_dtype=torch.bfloat16, model_dtype=torch.bfloat16, page_size=1,
                sliding_window_size=None, spec_algorithm=SpeculativeAlgorithm.from_string("FROZEN_KV_MTP"),
                is_draft_worker=False, post_capture_kv_active=False, spec_aux_config=SpecAuxHiddenStateConfig(),
                is_hybrid_swa=False, is_hybrid_swa_compress=False,
                use_mla_backend=mc.attention_arch == AttentionArch.MLA,
                layer_info=ModelLayerInfo(start_layer=0, end_layer=n, num_effective_layers=n), forward_stream=None,
                req_to_token_pool=None, token_to_kv_pool_allocator=None, memory_pool_config=None,
            )
            seen = {}
            real_budget = kvc_mod.KVCacheConfigurator.config_from_budget
            real_mamba = kvc_mod.KVCacheConfigurator._handle_max_mamba_cache

            def spy_budget(self, budget_bytes, **kw):
                seen["kv_budget"] = budget_bytes
                return real_budget(self, budget_bytes, **kw)

            def spy_mamba(self, total_rest_memory):
                seen["rest"] = total_rest_memory
                return real_mamba(self, total_rest_memory)

            try:
                with mock.patch.object(kvc_mod, "get_available_gpu_memory", return_value=float(free_gib)), \
                        mock.patch.object(kvc_mod.KVCacheConfigurator, "config_from_budget", spy_budget), \
                        mock.patch.object(kvc_mod.KVCacheConfigurator, "_handle_max_mamba_cache", spy_mamba):
                    # configure() up to the request pool: sizing, then the HybridReqToTokenPool
                    # (and its MambaPool) built as _init_pools builds it
                    config = conf._resolve_memory_pool_config(float(total_gib))
                    sizes = conf._derive_pool_sizes(config=config)
                    req_pool = conf._build_req_to_token_pool(max_num_reqs=sizes.max_running_requests)
            except (FlagError, RuntimeError, ValueError) as e:
                res.refused = f"{type(e).__name__}: {e}"
                return res
            pool = req_pool.mamba_pool
            res.max_total_num_tokens = sizes.max_total_num_tokens
            res.max_running_requests = sizes.max_running_requests
            res.max_mamba_cache_size = pool.size
            res.mamba_ratio = conf._calculate_mamba_ratio()
            res.slot_bytes = mc.hf_config.mamba2_cache_params.mamba_cache_per_req
            res.rest_bytes = int(seen["rest"] * (1 << 30))
            res.kv_budget_bytes = seen["kv_budget"]
            res.kv_cell_bytes = int(create_memory_pool_configurator(conf)._cell_size)
            res.spec, res.rows = _spec_buffers(pool)
            state = getattr(pool, hooks.POOL_ATTR, None)
            res.verify = None if state is None else state.verify
    return res
