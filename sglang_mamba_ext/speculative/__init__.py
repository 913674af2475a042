"""Speculative decoding with a deferred state update for hybrid models (``docs/design.md``,
"Speculative verify", "Deferred update", "Replay"). Serving-path code: :mod:`.tree` (EAGLE
draft trees as ``retrieve_parent_token``, greedy acceptance, the verify index tables
``TreeIndex``), :mod:`.verify_buffers` (node-state buffers of the snapshot and deferred modes,
snapshot commit), :mod:`.stash` (the accepted tokens' raw mixer inputs), :mod:`.replay` (stash
-> main state, with ping-pong checkpoints), :mod:`.deferred` (one pool's deferred state driven
by capture / commit / replay / clear) and :mod:`.ops` (each kernel beside its torch reference:
``ops/replay``, ``ops/verify``, shared Triton helpers in ``ops/triton_utils.py``).
Reference-only code lives in :mod:`.reference` (the reference decode loop, the frozen-KV draft
head, memory sizing); the seeded tiny target + draft pair of the tests is
:mod:`sglang_mamba_ext.testing.spec_pair`. No module here imports SGLang (its glue is
``sglang_mamba_ext/plugin/speculative``).
"""
