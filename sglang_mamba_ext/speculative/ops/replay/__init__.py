"""Replay op (``docs/design.md``, "Replay"): :mod:`.naive` (torch reference, the mixer's own
segment runner) and :mod:`.fused` (Triton, all layers in two launches), one signature; the
dispatch, planning and weights live in :mod:`sglang_mamba_ext.speculative.replay`."""
