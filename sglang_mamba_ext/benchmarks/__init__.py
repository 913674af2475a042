"""Benchmarks of this project, run as modules (as SGLang ships ``python -m sglang.bench_serving``):

- ``python -m sglang_mamba_ext.benchmarks.tree_ops``: the cache cycle of the plugin's
  ``MambaRadixCacheAdapter`` vs SGLang's ``UnifiedRadixCache`` on the shared multi-turn
  trace, both under the same SGLang scheduler functions; last line
  ``speedup=... hit_ratio=...``.
- ``python -m sglang_mamba_ext.benchmarks.hit_rate``: usable hit rate and recomputed prefill
  of SGLang's mamba strategies vs this cache's variants, an offline bound (:mod:`.oracle`)
  and a provable upper bound (:mod:`.upper_bound`), on the shared trace and a chat-shaped
  synthetic workload (:mod:`.chat_workload`); last line
  ``hit_ratio=... oracle_ratio=... upper_bound_ratio=...``.
- ``python -m sglang_mamba_ext.benchmarks.serving_cpu``: the CPU server with
  ``--enable-mamba-radix`` vs ``--disable-radix-cache``; last line
  ``prefill_tokens_saved=... ttft_ratio=...``.
- ``python -m sglang_mamba_ext.benchmarks.spec_memory``: memory of the speculative SSM
  buffers, snapshot vs deferred; last line ``peak_reduction=... resident_reduction=...``.

- ``python -m sglang_mamba_ext.benchmarks.tiers_gpu`` (GPU): what a hit costs from each tier
  of the tree's states, the core's pools at Qwen3-Next shapes; last line
  ``int8_load_ratio=... host_load_ratio=... host_load_gbps=...`` (run by ``scripts/gpu_check.sh``).

``scripts/bench_tree_ops.py``, ``scripts/bench_hit_rate.py``, ``scripts/bench_serving_cpu.py``
and ``scripts/plan_spec_memory.py`` are thin entry points to the same ``main`` functions.

Shared code: :mod:`.common` (trace loading, the ``CacheDriver`` interface, the tree-ops
runner), :mod:`.scheduler` (the request cycle of SGLang's scheduler functions over any
``BasePrefixCache``), :mod:`.upstream` and :mod:`.ours` (the two sides).

Layering: this package sits above the plugin layer, like a user of it, and imports
``sglang`` (and ``sglang_mamba_ext.plugin``) freely; nothing in ``sglang_mamba_ext`` below it
imports it. Importing the package itself loads nothing heavy: each benchmark module imports
SGLang when its drivers are built.
"""
