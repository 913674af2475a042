"""Kernels of the speculative verify and the deferred update, each op beside its torch
reference (fla's ``ops/<op>/{naive.py, fused.py}`` habit): :mod:`.replay` (stashed tokens into
the main conv/SSM state, ``docs/design.md`` "Replay") and :mod:`.verify` (tree verify of one
linear layer, "Speculative verify"); ``naive.py`` is plain torch on the layer math of
``models/linear_attn.py``, ``fused.py`` the Triton kernels, compared under
``TRITON_INTERPRET=1``; :mod:`.triton_utils` holds the Triton gated-delta-rule step and the
launch helpers both kernels use, :mod:`.gpu_check` the GPU check of the kernels. Nothing here
imports SGLang, and importing a package here imports no Triton.
"""
