"""Tree-verify op of one linear layer (``docs/design.md``, "Speculative verify"):
:mod:`.naive` (torch conv windows and recurrence along the tree) and :mod:`.fused` (Triton
recurrence, buffered or on-chip)."""
