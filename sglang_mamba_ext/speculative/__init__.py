"""Speculative decoding with a deferred state update for hybrid models (seed §8–9).

Where each mechanism lives (no module here imports SGLang; the SGLang glue is
``sglang_mamba_ext/plugin/speculative``):

- §9.6 tree-node parents, §9.4/§9.9 greedy acceptance along an EAGLE tree: :mod:`.tree`
- §9.3 what is stashed per accepted token (raw mixer inputs, ``GatedDeltaRuleMixer.project_raw``): :mod:`.stash`
- §8.3–8.4 snapshot verify + scatter, §9.5 one-layer buffer, tree conv/recurrence (torch
  reference): :mod:`.verify`; on-chip / buffered Triton tree verify: :mod:`.verify_triton`
- §9.2, §9.8, §9.10 replay with ping-pong checkpoints: :mod:`.replay` (torch reference +
  dispatch), :mod:`.replay_triton` (kernels)
- one pool's deferred state driven by capture / commit / replay / clear: :mod:`.deferred`

Reference-only code, apart from the serving path (:mod:`.reference`): §8.1–8.2 frozen-KV
MTP draft head and tree proposal (:mod:`.reference.draft_head`), the reference decode loop
comparing snapshot and deferred verify on the tiny hybrid model
(:mod:`.reference.decode_loop`), §8.5 / §9.7 memory of both modes
(:mod:`.reference.sizing`, ``scripts/plan_spec_memory.py``). The seeded tiny target + draft
pair of the tests is :mod:`sglang_mamba_ext.testing.spec_pair`.
"""
