"""Shared set-up for the tests of the SGLang glue (``sglang_mamba_ext/plugin``): the tiny
model directory, the plugin's hooks applied in this process, a scheduler-side runtime
context built from parsed command-line flags, and pools / caches built through SGLang's own
code paths on ``device="cpu"``. Only for tests that need SGLang (they fail, not skip,
when SGLang is installed but broken)."""

from __future__ import annotations

import contextlib
import pickle
from array import array
from types import SimpleNamespace
from typing import List, Optional

import torch

from conftest import tiny_model_dir  # noqa: F401  (shared with the e2e tests; built once per process)


def apply_plugin_hooks() -> None:
    """Run the entry point and apply SGLang's hook registry in this process (what
    ``load_plugins()`` does). Idempotent."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_mamba_ext.plugin.registration import register

    register()
    HookRegistry.apply_hooks()


def parse_args(argv: List[str]):
    """``prepare_server_args`` (the launcher's parser, with the plugin's flags)."""
    apply_plugin_hooks()
    from sglang.srt.server_args import prepare_server_args

    return prepare_server_args(argv)


def scheduler_context(argv: List[str]):
    """The runtime context a scheduler process would publish for ``argv``: parsed,
    pickled (as the launcher hands it to the child) and resolved."""
    from sglang.srt.runtime_context import create_context

    server_args = pickle.loads(pickle.dumps(parse_args(argv)))
    return create_context(server_args, role="scheduler"), server_args


def base_argv(*extra: str) -> List[str]:
    return ["--model-path", tiny_model_dir(), "--device", "cpu", *extra]


def build_req_pool(max_num_reqs: int = 4, context_len: int = 256):
    """SGLang's ``KVCacheConfigurator._build_hybrid_req_pool`` (with the plugin's AROUND
    hook) on a configurator holding only what that method reads. Call inside the context."""
    from transformers import AutoConfig

    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator

    hf = AutoConfig.from_pretrained(tiny_model_dir())
    stub = object.__new__(KVCacheConfigurator)
    stub.mambaish_config = hf
    stub.layer_info = SimpleNamespace(start_layer=0, end_layer=hf.num_hidden_layers)
    stub.model_config = SimpleNamespace(context_len=context_len)
    stub.device = "cpu"
    stub.hybrid_kda_config = None
    stub.hybrid_gdn_config = None
    return KVCacheConfigurator._build_hybrid_req_pool(stub, max_num_reqs=max_num_reqs, extra_max_context_len=0)


def build_tree_cache(pool, kv_size: int, page_size: int = 1):
    """SGLang's ``registry.create_tree_cache`` over ``pool`` and a real
    ``TokenToKVPoolAllocator`` of ``kv_size`` tokens. Call inside the context."""
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_tree_cache
    from sglang.srt.runtime_context import get_exec, get_memory, get_server_args

    allocator = TokenToKVPoolAllocator(kv_size, torch.float32, "cpu", None, False)
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=pool,
        token_to_kv_pool_allocator=allocator,
        page_size=page_size,
        enable_mamba_extra_buffer=get_exec().mamba.enable_mamba_extra_buffer,
        enable_mamba_extra_buffer_lazy=get_exec().mamba.enable_mamba_extra_buffer_lazy,
        eviction_policy=get_memory().radix_eviction_policy,
    )
    ctx = TreeCacheBuildContext(
        server_args=get_server_args(),
        params=params,
        is_hybrid_swa=False,
        is_hybrid_ssm=True,
        enable_hierarchical_cache=False,
        disable_radix_cache=False,
        tp_worker=None,
        model_config=None,
        tp_size=1,
        tp_rank=0,
        tp_group=None,
    )
    return create_tree_cache(ctx), allocator


def make_req(rid: str, ids: List[int], max_new_tokens: int = 8, cache_salt: Optional[str] = None):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    return Req(
        rid,
        "",
        array("q", ids),
        SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0),
        cache_salt=cache_salt,
    )


@contextlib.contextmanager
def in_context(ctx):
    from sglang.srt.runtime_context import use_context

    with use_context(ctx):
        yield ctx
