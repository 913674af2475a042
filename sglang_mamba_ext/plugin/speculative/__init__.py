"""SGLang glue of the deferred-update speculative verify: ``--mamba-spec-state-update``.

Without the flag every hook below returns SGLang's own result and the parsed ``ServerArgs``
carries no extra attribute; a bad combination with it is refused at start-up like an
argparse error (:mod:`sglang_mamba_ext.plugin.startup_errors`). Mechanism and invariants:
``docs/design.md``, "SGLang wiring".

``--mamba-spec-state-update {snapshot,deferred}`` (default ``snapshot``, SGLang's own path).
With ``deferred`` and ``--speculative-algorithm FROZEN_KV_MTP``, ``NEXTN`` or ``EAGLE`` (SGLang's
``FrozenKVMTPWorkerV2`` / ``EAGLEWorkerV2``; NEXTN runs as EAGLE with the model's own MTP head,
e.g. ``Qwen3NextForCausalLMMTP``) on a linear-attention hybrid whose
backend has an adapter — SGLang's ``KDAAttnBackend`` (Kimi-Linear), its ``GDNAttnBackend``
(Qwen3-Next), its ``Mamba2AttnBackend`` (Nemotron-H, Falcon-H1, GraniteMoeHybrid: :mod:`.mamba2_verify`)
and this project's tiny backend (KDA or GDN gate) — described to the shared code by a
``StateLayout`` (``speculative/deferred.py``: gate per channel or per head, state layouts, whether
the verify conv kernel rolls the main window):

- the Mamba pool is built without SGLang's intermediate SSM / conv-window buffers
  ``[L, N+1, T, ...]``; it gets a one-layer conv-window buffer ``[N+1, T, ...]`` handed to
  SGLang's verify conv kernel as an ``[L, N+1, T, ...]`` view with layer stride 0, so every
  layer's tree verify writes and reads its node windows in the same memory
  (``MambaPool.__init__``). The SSM node states: where the per-rank head dims and the tree
  depth fit on chip (``speculative/verify_onchip.py``; Kimi-Linear, Qwen3-Next and the tiny
  model do) there is no node-state SSM buffer at all — the backend's recurrent verify
  (``kernel_dispatcher.target_verify``, called by SGLang's own verify code after its conv
  kernel) is replaced for the call by the on-chip Triton kernel, which recomputes each node's
  state from the main state along its path in registers; otherwise a one-layer node-state
  buffer ``[N+1, T, ...]`` seen as ``L`` layers, written and read by SGLang's kernel
  (``SGLANG_MAMBA_EXT_DEFERRED_VERIFY=one_layer`` / ``on_chip`` forces a variant);
- during verify each linear layer's raw inputs (``mixed_qkv``, ``a``, ``b`` — exactly the
  backend's arguments) are copied into a pending workspace, and the batch's main conv windows,
  which SGLang's verify conv kernel rolls in place by all draft tokens (snapshot mode undoes
  that in its commit scatter), are saved before and restored after the layer
  (``KDAAttnBackend._forward_target_verify``, ``GDNAttnBackend.forward_extend`` for target
  verify, the tiny backend calling ``hooks.capture_verify_inputs`` itself; the tiny verify does
  not touch the main window);
- after acceptance the accepted tokens' records are gathered into the stash and the main
  state is left alone (``spec_utils.commit_mamba_states_after_verify``);
- the next decode round starts by replaying the stash into the main conv window and SSM
  state, writing the ping-pong checkpoint at a ``mamba_track_interval`` crossing (a BEFORE
  hook on each worker's round entry, ``hooks.WORKER_ENTRY_POINTS``:
  ``FrozenKVMTPWorkerV2.forward_batch_generation`` and
  ``EAGLEWorkerV2.forward_batch_generation``; FrozenKVMTP's overrides EAGLE's without calling
  it, so a round replays once; the hook does not look at the layout). Both workers verify
  through ``eagle_worker_common.run_eagle_verify`` (the backend hooks above, then the commit
  hook). EAGLE's MTP draft shares the target's ``req_to_token_pool`` (no Mamba pool of its
  own), runs attention layers only (its draft-extend pass skips the linear metadata,
  ``HybridLinearAttnBackend.init_forward_metadata``) and so never reads or writes the SSM
  state; its draft runs after the replay, on the target's hidden states from the verify;
- a request whose state is about to be cached replays first, cut at ``prompt + output[:-1]``
  (also when its last round accepted drafts past the stop: the cache is told the working
  state's length, ``CacheReq.mamba_working_len``, so the whole turn is reused), and one
  released without caching drops its records
  (``mem_cache.common.release_kv_cache``, ``ReqToTokenPool.free_rows``).

CUDA graphs: replay runs **outside** CUDA graphs, as two eager Triton launches on the forward
stream right before the round's draft/verify (the stream orders it before the verify graph).
Reasons: it must also run where no graph exists (flushes from the scheduler when a request is
cached), its work is tiny (state tile in, state tile out: 2 launches per round, ~10 us of launch
cost), and keeping it out of the verify graph keeps SGLang's captured graphs unchanged. The
pending-activation copies sit inside the verify forward and are captured with it (fixed
workspace addresses; the workspace is preallocated for that reason).

Relation to ``--enable-linear-replayssm-spec`` (SGLang 0.5.23's ReplaySSM spec path): both drop
the per-layer intermediate SSM buffer and recompute the committed state from saved inputs, but
ReplaySSM requires a linear draft chain (``--speculative-eagle-topk 1``; GDN ring + cursors, KDA
fold-every-commit at commit time), whereas ``deferred`` handles EAGLE trees (topk > 1) through
``retrieve_parent_token`` and replays at the start of the next round. They replace the same
buffers, so combining them is refused at start-up, as are: ``deferred`` without speculative
decoding or with an algorithm other than FROZEN_KV_MTP / NEXTN / EAGLE (EAGLE3, STANDALONE), a
draft model that has Mamba/linear layers (read off the loaded draft: a model's MTP head carries
the target's hybrid config but builds attention layers only), a target without them, a
short-conv, Mamba1 or CCA target (no replay kernel for them),
``--enable-linear-replayssm``, and the overlap scheduler (``--disable-overlap-schedule`` is
required: the state update of round N moves to the start of round N+1, which overlap would run
while round N's results, including cache inserts, are still being processed).

CLI plumbing: the flag is added by an AFTER hook on ``ServerArgs.add_cli_args`` and, when
given, read by an AFTER hook on ``ServerArgs.from_cli_args`` into
``server_args._mamba_spec_state_update`` (an underscore attribute, carried to the
scheduler/worker processes with the pickled ServerArgs and read there through
``runtime_context.get_server_args()``).

The KDA safe gate (``lower_bound``) is captured as a raw gate of KDA's usual form
(``plugin/inchunk_checkpoints.py::safe_gate_as_raw``). Not covered here: ragged verify
layouts, overlap scheduling, tensor parallelism of the stash (per-rank shapes work,
untested), SGLang's ReplaySSM ring or fused-accept verify together with the on-chip variant
(refused at the verify call). The pending workspace and the verify buffers are preallocated
(fixed addresses for CUDA graphs), so this glue's footprint is the planner's peak for the
variant it built (``scripts/plan_spec_memory.py``, also
``python -m sglang_mamba_ext.benchmarks.spec_memory``). SGLang's memory budget
(``KVCacheConfigurator._handle_max_mamba_cache``) charges that state's bytes instead of the
snapshot buffers' (:mod:`.budget`), so the saving becomes SSM slots and running requests.
"""

from __future__ import annotations

from typing import List, Tuple

__all__ = ["register_spec_hooks", "HOOK_TARGETS", "hook_function"]

_KDA = "sglang.srt.layers.attention.linear.kda_backend.KDAAttnBackend._forward_target_verify"
_GDN = "sglang.srt.layers.attention.linear.gdn_backend.GDNAttnBackend.forward_extend"

#: (target, hook type name, hook function name in :mod:`.hooks`, or ``module.function`` for
#: another module of this package)
HOOK_TARGETS: List[Tuple[str, str, str]] = [
    ("sglang.srt.server_args.ServerArgs.add_cli_args", "AFTER", "add_cli_args_after"),
    ("sglang.srt.server_args.ServerArgs.from_cli_args", "AFTER", "from_cli_args_after"),
    ("sglang.srt.model_executor.model_runner.ModelRunner.__init__", "AFTER", "model_runner_init_after"),
    ("sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._init_pools", "BEFORE",
     "configurator_init_pools_before"),
    ("sglang.srt.mem_cache.memory_pool.MambaPool.__init__", "AROUND", "mamba_pool_init_around"),
    (_KDA, "AROUND", "kda_target_verify_around"),
    (_GDN, "AROUND", "gdn_forward_extend_around"),
    ("sglang.srt.speculative.spec_utils.commit_mamba_states_after_verify", "AROUND", "commit_around"),
    # the replay point of each speculative worker's round (hooks.WORKER_ENTRY_POINTS)
    ("sglang.srt.speculative.frozen_kv_mtp_worker_v2.FrozenKVMTPWorkerV2.forward_batch_generation", "BEFORE",
     "worker_forward_before"),
    ("sglang.srt.speculative.eagle_worker_v2.EAGLEWorkerV2.forward_batch_generation", "BEFORE",
     "worker_forward_before"),
    # Mamba2 targets: capture of xBC / dt and the main conv windows kept (mamba2_verify.py)
    ("sglang.srt.layers.attention.hybrid_linear_attn_backend.Mamba2AttnBackend.forward", "AROUND",
     "mamba2_verify.mamba2_forward_around"),
    ("sglang.kernels.ops.mamba.triton_ops.ssu_dispatch.selective_state_update", "AROUND", "mamba2_verify.ssu_around"),
    ("sglang.srt.mem_cache.common.release_kv_cache", "BEFORE", "release_kv_cache_before"),
    ("sglang.srt.mem_cache.memory_pool.ReqToTokenPool.free_rows", "BEFORE", "free_rows_before"),
    # SGLang's memory budget: the deferred state's bytes replace the snapshot buffers' (budget.py)
    ("sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._handle_max_mamba_cache", "AROUND",
     "budget.handle_max_mamba_cache_around"),
]


def hook_function(name: str):
    """The function a :data:`HOOK_TARGETS` entry names (``fn`` in :mod:`.hooks`, or ``module.fn``)."""
    import importlib

    mod, _, fn = name.rpartition(".")
    return getattr(importlib.import_module(f"{__name__}.{mod or 'hooks'}"), fn)

_registered = False


def register_spec_hooks() -> None:
    """Register the hooks of :data:`HOOK_TARGETS` with SGLang's HookRegistry (idempotent).

    Called from the plugin's ``register()``; SGLang applies them after all plugins ran
    (``sglang/srt/plugins/__init__.py::load_plugins``). Every hook is inert unless
    ``--mamba-spec-state-update deferred`` was given.
    """
    global _registered
    if _registered:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_mamba_ext.plugin.speculative import cpu_routing

    for target, kind, name in HOOK_TARGETS:
        HookRegistry.register(target, hook_function(name), getattr(HookType, kind))
    # The pp_proxy_tensors workaround (every device) and the CPU routing of the speculative
    # path (inert unless cpu_routing.CPU_SPEC_ENV is 1 on a host without CUDA).
    for target, kind, name in cpu_routing.CPU_HOOK_TARGETS:
        HookRegistry.register(target, getattr(cpu_routing, name), getattr(HookType, kind))
    # SGLang's own MTP drafts (NEXTN / EAGLE) on CPU (issue 41; inert likewise)
    from sglang_mamba_ext.plugin.speculative import cpu_mtp

    for target, kind, name in cpu_mtp.CPU_MTP_HOOK_TARGETS:
        HookRegistry.register(target, getattr(cpu_mtp, name), getattr(HookType, kind))
    _registered = True
