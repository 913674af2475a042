"""SGLang 0.5.23's speculative path (FROZEN_KV_MTP) on a host without CUDA, and the
``pp_proxy_tensors`` workaround (issue 12, items 2 and 3; facts: ``docs/sglang-hooks.md``).

Routing is on only when :data:`CPU_SPEC_ENV` is ``1`` and CUDA is absent. The plugin's CPU
defaults set it (with ``TRITON_INTERPRET=1`` and ``TORCHDYNAMO_DISABLE=1``) at start-up for a
``--device cpu`` launch with ``--speculative-algorithm`` whose model is the project's tiny
model or that passes ``--enable-mamba-radix`` (:mod:`sglang_mamba_ext.plugin.cpu_defaults`);
the scheduler processes inherit it. Otherwise every hook returns SGLang's own result.

Why each hook (SGLang's CPU branches need ``SGLANG_USE_CPU_ENGINE=1`` and ``sgl_kernel``'s
CPU ops, which PyPI's CUDA-only ``sglang-kernel`` lacks; without them the "other" branch runs):

- ``kernels/ops/speculative/cache_locs.assign_extend_cache_locs_func`` (verify KV locations):
  no branch for this host, returns None and the KV write fails; here a torch gather of
  ``req_to_token[row, start:end]``.
- ``kernels/ops/mamba/mamba_state_scatter_triton.scatter_mamba_states_after_mtp_verify``
  (commit of the accepted node's SSM / conv state): the fused Triton scatter refuses CPU
  tensors; here SGLang's own torch scatter
  (``HybridLinearAttnBackend._scatter_speculative_state_with_mask``).
- ``kernels/ops/speculative/spec_tree.build_tree_kernel_efficient_func`` and
  ``verify_tree_greedy_func``: the CPU wrappers need ``sgl_kernel`` (build raises, greedy
  verify would leave its outputs untouched); here SGLang's Triton versions (the ones its XPU
  path calls) under Triton's interpreter.
- ``speculative/eagle_utils._verify_uses_greedy``: False for a batch with a sampled request
  (``temperature > 0``) unless SGLang's ``is_cpu`` (``SGLANG_USE_CPU_ENGINE=1``), and then its
  sampling kernels (CUDA-only, None here) stop the scheduler; here True, SGLang's own CPU answer:
  verify commits the target's argmax.
- ``layers/attention/torch_native_backend.TorchNativeAttnBackend.forward_extend``: no tree
  mask; in target verify each row attends over its prefix K/V plus its draft nodes with
  ``spec_info.custom_mask`` (EAGLE's full mask, ``[T, prefix + T]`` per row).
- ``speculative/frozen_kv_mtp_worker_v2.FrozenKVMTPDraftWorker._init_draft_attn_backend``:
  topk > 1 accepts only ``triton`` / ``trtllm_mha``; here the draft runner's own backend
  (``torch_native``), which handles the ``bs * topk`` expanded decode rows.
"""

from __future__ import annotations

import inspect
import logging
import os

import torch

logger = logging.getLogger(__name__)

#: Set to ``1`` by the CPU defaults when speculation runs on a host without CUDA.
CPU_SPEC_ENV = "SGLANG_MAMBA_EXT_CPU_SPEC"

_FKV = "sglang.srt.speculative.frozen_kv_mtp_worker_v2"
#: (target, hook type name, function name in this module)
CPU_HOOK_TARGETS = [
    (f"{_FKV}.FrozenKVMTPWorkerV2.forward_batch_generation", "BEFORE", "drop_pp_proxy_tensors_before"),
    ("sglang.kernels.ops.speculative.cache_locs.assign_extend_cache_locs_func", "AROUND",
     "assign_extend_cache_locs_around"),
    ("sglang.kernels.ops.mamba.mamba_state_scatter_triton.scatter_mamba_states_after_mtp_verify", "AROUND",
     "scatter_after_verify_around"),
    ("sglang.kernels.ops.speculative.spec_tree.build_tree_kernel_efficient_func", "AROUND", "build_tree_around"),
    ("sglang.kernels.ops.speculative.spec_tree.verify_tree_greedy_func", "AROUND", "verify_tree_greedy_around"),
    ("sglang.srt.speculative.eagle_utils._verify_uses_greedy", "AROUND", "verify_uses_greedy_around"),
    ("sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_extend", "AROUND",
     "torch_native_forward_extend_around"),
    (f"{_FKV}.FrozenKVMTPDraftWorker._init_draft_attn_backend", "AROUND", "init_draft_attn_backend_around"),
]


def cpu_spec_active() -> bool:
    """Whether the CPU speculative routing is on in this process."""
    return os.environ.get(CPU_SPEC_ENV) == "1" and not torch.cuda.is_available()


# -- item 3: upstream defect, every device ---------------------------------------------------


def drop_pp_proxy_tensors_before(worker, *args, **kwargs):
    """BEFORE ``FrozenKVMTPWorkerV2.forward_batch_generation``: SGLang's non-overlap scheduler
    (``managers/scheduler.py``) passes ``pp_proxy_tensors=`` to every model worker, and this
    method has no such parameter (TypeError on every device with
    ``--disable-overlap-schedule``). A ``None`` value (no pipeline parallelism) is dropped;
    anything else is passed on unchanged, so SGLang's own error still shows."""
    if "pp_proxy_tensors" in kwargs and kwargs["pp_proxy_tensors"] is None:
        kwargs = {k: v for k, v in kwargs.items() if k != "pp_proxy_tensors"}
        return (worker, *args), kwargs
    return None


# -- item 2: CPU routing ---------------------------------------------------------------------


def assign_extend_cache_locs_around(original, *args, **kwargs):
    """AROUND ``assign_extend_cache_locs_func``: on CPU, ``out[i*D:(i+1)*D] =
    req_to_token[req_pool_indices[i], start[i]:end[i]]`` (int64 ``[batch*D]`` KV slots,
    ``D = draft_token_num``).

    Raises:
        ValueError: a row whose ``end - start`` is not ``draft_token_num``."""
    if not cpu_spec_active():
        return original(*args, **kwargs)
    a = inspect.signature(original).bind(*args, **kwargs).arguments
    rt = a["req_to_token"]
    if rt.device.type != "cpu":
        return original(*args, **kwargs)
    bs, d = int(a["batch_size"]), int(a["draft_token_num"])
    rows = a["req_pool_indices"][:bs].to(torch.long)
    start = a["start_offset"][:bs].to(torch.long)
    end = a["end_offset"][:bs].to(torch.long)
    if bool(((end - start) != d).any()):
        raise ValueError(f"assign_extend_cache_locs (CPU): every row must extend {d} tokens, got {(end - start).tolist()}")
    cols = start[:, None] + torch.arange(d, dtype=torch.long)[None, :]
    return rt[rows[:, None], cols].reshape(-1).to(torch.int64)


def scatter_after_verify_around(original, mamba_caches, state_indices_tensor, last_correct_step_indices,
                                mamba_track_indices, mamba_steps_to_track, src_indices_raw=None):
    """AROUND ``scatter_mamba_states_after_mtp_verify``: on CPU tensors, the same commit
    through SGLang's torch scatter: the SSM state and every conv window of the accepted node
    (``intermediate_*[:, row, step]``) into ``state_indices_tensor``, and of the track step
    into ``mamba_track_indices`` when tracking."""
    if not (cpu_spec_active() and mamba_caches.temporal.device.type == "cpu"):
        return original(mamba_caches, state_indices_tensor, last_correct_step_indices,
                        mamba_track_indices, mamba_steps_to_track, src_indices_raw=src_indices_raw)
    from sglang.srt.layers.attention.hybrid_linear_attn_backend import HybridLinearAttnBackend

    scatter = HybridLinearAttnBackend._scatter_speculative_state_with_mask
    pairs = [(mamba_caches.temporal, mamba_caches.intermediate_ssm)]
    pairs += list(zip(mamba_caches.conv, mamba_caches.intermediate_conv_window))
    for dst, src in pairs:
        if dst is None or src is None or dst.numel() == 0:
            continue
        scatter(dst, src, state_indices_tensor, last_correct_step_indices, src_indices_raw)
        if mamba_track_indices is not None:
            scatter(dst, src, mamba_track_indices, mamba_steps_to_track, src_indices_raw)


def build_tree_around(original, *args, **kwargs):
    """AROUND ``build_tree_kernel_efficient_func``: on CPU, SGLang's Triton tree build
    (``sgl_build_tree_kernel_triton``, same arguments) under the interpreter."""
    if not cpu_spec_active():
        return original(*args, **kwargs)
    from sglang.kernels.ops.speculative import spec_tree

    a = inspect.signature(original).bind(*args, **kwargs).arguments
    spec_tree.sgl_build_tree_kernel_triton(
        a["parent_list"], a["top_scores_index"], a["seq_lens"], a["tree_mask"], a["positions"],
        a["retrieve_index"], a["retrieve_next_token"], a["retrieve_next_sibling"],
        a["topk"], a["spec_steps"], a["num_verify_tokens"], a["tree_mask_mode"],
    )


def verify_tree_greedy_around(original, *args, **kwargs):
    """AROUND ``verify_tree_greedy_func``: on CPU, SGLang's Triton greedy verify
    (``verify_tree_greedy_triton``) under the interpreter; returns ``(predicts,
    accept_index, accept_token_num)`` as the original."""
    if not cpu_spec_active():
        return original(*args, **kwargs)
    from sglang.kernels.ops.speculative import spec_tree

    a = inspect.signature(original).bind(*args, **kwargs).arguments
    spec_tree.verify_tree_greedy_triton(
        predicts=a["predicts"], accept_index=a["accept_index"], accept_token_num=a["accept_token_num"],
        candidates=a["candidates"], retrieve_index=a["retrieve_index"],
        retrieve_next_token=a["retrieve_next_token"], retrieve_next_sibling=a["retrieve_next_sibling"],
        target_predict=a["target_predict"],
    )
    return a["predicts"], a["accept_index"], a["accept_token_num"]


def verify_uses_greedy_around(original, *args, **kwargs):
    """AROUND ``speculative/eagle_utils.py::_verify_uses_greedy``: on CPU, True, as SGLang's
    own CPU engine answers (its ``is_cpu`` term, which needs ``SGLANG_USE_CPU_ENGINE=1``): a
    verify batch with sampled requests commits the target's argmax instead of calling the
    CUDA-only sampling kernels (``top_p_renorm_prob``, ``tree_speculative_sampling_target_only``:
    None on this host, so a ``temperature > 0`` request stopped the scheduler with a TypeError).
    Speculative rounds on CPU are therefore greedy (``docs/speculative.md``)."""
    if cpu_spec_active():
        return True
    return original(*args, **kwargs)


def tree_verify_attention(q, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens, out_cache_loc,
                          custom_mask, draft_token_num: int, scaling: float) -> torch.Tensor:
    """Attention of a target-verify batch with EAGLE's full tree mask.

    ``q`` ``[bs*T, NH, D]``; ``k_buf`` / ``v_buf`` ``[slots, NKV, D]`` (the draft nodes' K/V
    already written at ``out_cache_loc`` ``[bs*T]``); row ``i`` attends over
    ``req_to_token[req_pool_indices[i], :seq_lens[i]]`` then its ``T`` nodes, masked by
    ``custom_mask[off_i : off_i + T*(seq_lens[i]+T)]`` viewed ``[T, seq_lens[i]+T]`` (bool,
    rows concatenated; layout of ``triton_backend.py``'s ``mask_indptr``). Returns
    ``[bs*T, NH, D]`` in ``q.dtype`` (softmax in float32)."""
    T = int(draft_token_num)
    bs = q.shape[0] // T
    NH, NKV = q.shape[1], k_buf.shape[1]
    out = torch.empty_like(q)
    off = 0
    lens = seq_lens[:bs].tolist()
    rows = req_pool_indices[:bs].tolist()
    for i in range(bs):
        L = int(lens[i])
        locs = torch.cat([req_to_token[rows[i], :L].to(torch.long), out_cache_loc[i * T:(i + 1) * T].to(torch.long)])
        k = k_buf[locs].float().repeat_interleave(NH // NKV, dim=1)
        v = v_buf[locs].float().repeat_interleave(NH // NKV, dim=1)
        mask = custom_mask[off: off + T * (L + T)].view(T, L + T).to(torch.bool)
        off += T * (L + T)
        scores = torch.einsum("thd,shd->hts", q[i * T:(i + 1) * T].float() * scaling, k)
        scores = scores.masked_fill(~mask[None], float("-inf"))
        out[i * T:(i + 1) * T] = torch.einsum("hts,shd->thd", torch.softmax(scores, dim=-1), v).to(q.dtype)
    return out


def torch_native_forward_extend_around(original, backend, q, k, v, layer, forward_batch, save_kv_cache=True, **kw):
    """AROUND ``TorchNativeAttnBackend.forward_extend``: in a target-verify batch with a tree
    mask on CPU, write the nodes' K/V and attend with :func:`tree_verify_attention`; any
    other batch goes to SGLang."""
    spec = getattr(forward_batch, "spec_info", None)
    mask = getattr(spec, "custom_mask", None)
    if not (cpu_spec_active() and forward_batch.forward_mode.is_target_verify() and mask is not None):
        return original(backend, q, k, v, layer, forward_batch, save_kv_cache, **kw)
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc  # noqa: F401  (same write path as SGLang)

    if save_kv_cache and k is not None and v is not None:
        backend.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc, backend.swa_out_cache_loc), k, v)
    q_ = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
    o = tree_verify_attention(
        q_, backend.token_to_kv_pool.get_key_buffer(layer.layer_id),
        backend.token_to_kv_pool.get_value_buffer(layer.layer_id),
        backend.req_to_token_pool.req_to_token, forward_batch.req_pool_indices, forward_batch.seq_lens,
        forward_batch.out_cache_loc, mask, spec.draft_token_num, layer.scaling,
    )
    return o.reshape(q_.shape[0], layer.tp_q_head_num * layer.v_head_dim)


def init_draft_attn_backend_around(original, worker, *args, **kwargs):
    """AROUND ``FrozenKVMTPDraftWorker._init_draft_attn_backend``: on CPU with topk > 1, the
    draft runner's own attention backend (``torch_native``) instead of the refused choice."""
    if cpu_spec_active() and getattr(worker, "topk", 1) > 1 and worker._resolve_draft_backend_type() not in (
            "triton", "trtllm_mha"):
        return worker.draft_model_runner.attn_backend
    return original(worker, *args, **kwargs)
