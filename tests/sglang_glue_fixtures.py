"""Shared set-up for the tests of the SGLang glue (``sglang_mamba_ext/plugin``): the tiny
model directory, the plugin's hooks applied in this process, a scheduler-side runtime
context built from parsed command-line flags, and pools / caches built through SGLang's own
code paths on ``device="cpu"`` (the tiny model, the pool and the cache with the builders of
``sglang_mamba_ext.benchmarks.ours``, which the tree-ops benchmark uses too)."""

from __future__ import annotations

import contextlib
import pickle
from array import array
from typing import List, Optional

import torch

from sglang_mamba_ext.benchmarks.ours import build_req_pool, build_tree_cache
from sglang_mamba_ext.benchmarks.scheduler import apply_plugin as apply_plugin_hooks
from sglang_mamba_ext.testing import tiny_model_dir

# Re-exported for the tests.
__all__ = ["apply_plugin_hooks", "build_req_pool", "build_tree_cache", "tiny_model_dir"]


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


def run_deferred_cow(pool, reqs):
    """SGLang's deferred copy-on-write / clear for ``reqs`` as a prefill runs it
    (``ScheduleBatch._collect_deferred_mamba_cow_and_clear``, then
    ``ModelRunner._maybe_execute_deferred_mamba_cow_and_clear`` on ``pool``). Returns the
    stand-in forward batch (an extend), for the backend plan API."""
    from types import SimpleNamespace

    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.model_executor.model_runner import ModelRunner

    cow = SimpleNamespace()
    ScheduleBatch._collect_deferred_mamba_cow_and_clear(cow, list(reqs))
    fb = SimpleNamespace(
        forward_mode=SimpleNamespace(
            is_extend=lambda: True, is_target_verify=lambda: False, is_draft_extend_v2=lambda: False
        ),
        mamba_clear_indices=cow.mamba_clear_indices,
        mamba_cow_src_indices=cow.mamba_cow_src_indices,
        mamba_cow_dst_indices=cow.mamba_cow_dst_indices,
    )
    ModelRunner._maybe_execute_deferred_mamba_cow_and_clear(
        SimpleNamespace(req_to_token_pool=pool, is_draft_worker=False), fb
    )
    return fb


def small_cache_params(layout: str, layers):
    """SGLang's cache params for 2 linear-attention heads, K = V = 8, conv width 4, fp32:
    Kimi-Linear's shapes (``layout="kda"``: conv ``[W-1, dim]``) or Qwen3-Next's (``"gdn"``:
    conv ``[dim, W-1]``), built by SGLang's own ``*StateShape.create`` (configs/mamba_utils.py);
    ``"mamba2"``: a Mamba2 mixer's (4 heads of 8, 2 groups, state 16, conv ``[dim, W-1]``)."""
    from sglang.srt.configs.mamba_utils import (
        KimiLinearCacheParams,
        KimiLinearStateShape,
        Mamba2CacheParams,
        Mamba2StateDType,
        Mamba2StateShape,
    )

    dtype = Mamba2StateDType(conv=torch.float32, temporal=torch.float32)
    if layout == "kda":
        shape = KimiLinearStateShape.create(tp_world_size=1, num_heads=2, head_dim=8, conv_kernel_size=4)
        return KimiLinearCacheParams(shape=shape, layers=list(layers), dtype=dtype)
    if layout == "mamba2":  # Nemotron-H-like: HV = 4 heads of P = 8, G = 2 groups, N = 16
        shape = Mamba2StateShape.create(tp_world_size=1, intermediate_size=32, n_groups=2, num_heads=4, head_dim=8,
                                        state_size=16, conv_kernel=4)
        return Mamba2CacheParams(shape=shape, layers=list(layers), dtype=dtype)
    shape = Mamba2StateShape.create(tp_world_size=1, intermediate_size=16, n_groups=2, num_heads=2, head_dim=8,
                                    state_size=8, conv_kernel=4)
    return Mamba2CacheParams(shape=shape, layers=list(layers), dtype=dtype)


def planned_pool_standin(pool, layer_ids, prefix_checkpoints, writer: bool):
    """Stand-in for the plugin's request pool as the in-chunk writers see it: SGLang's real
    ``MambaPool`` (``pool``) behind ``mamba2_layer_cache(layer_id)``, the planned
    ``{request row: [(seqlen, SSM slot), ...]}`` and the plugin's own
    ``MambaRadixReqToTokenPool.prefix_checkpoint_plan`` over them."""
    from types import SimpleNamespace

    from sglang_mamba_ext.plugin.pool import MambaRadixReqToTokenPool

    index = {lid: i for i, lid in enumerate(layer_ids)}
    rtp = SimpleNamespace(
        prefix_checkpoint_writer=writer,
        prefix_checkpoints=prefix_checkpoints,
        mamba2_layer_cache=lambda lid: pool.mamba2_layer_cache(index[lid]),
    )
    rtp.prefix_checkpoint_plan = lambda fb: MambaRadixReqToTokenPool.prefix_checkpoint_plan(rtp, fb)
    return rtp


class ExtendMode:
    """``forward_batch.forward_mode`` of a plain prefill (extend), for the writers' tests."""

    def is_extend(self):
        return True

    def is_target_verify(self):
        return False

    def is_draft_extend_v2(self):
        return False
