"""SGLang 0.5.23's own MTP drafts (``--speculative-algorithm NEXTN`` / EAGLE with a hybrid
model's MTP class) on a host without CUDA (issue 41, item 2).

Like :mod:`.cpu_routing`, every hook here is inert unless the CPU speculative routing is on
(:func:`.cpu_routing.cpu_spec_active`: the plugin's CPU defaults set it for a ``--device cpu``
speculative launch of the project's tiny checkpoints or under ``--enable-mamba-radix``);
otherwise SGLang's own code runs unchanged.

What SGLang does that a host without CUDA cannot, and what each hook does instead:

- ``models/qwen3_next.py`` ``Qwen3NextForCausalLM.set_embed_and_head`` (line 1115; inherited by
  ``Qwen3NextForCausalLMMTP``) and ``models/nemotron_h.py``
  ``NemotronHForCausalLM.set_embed_and_head`` (line 1217; ``NemotronHForCausalLMMTP`` calls it
  when it does not own an LM head): after sharing the target's embedding and LM head with the
  draft they call ``torch.cuda.empty_cache()`` and ``torch.cuda.synchronize()``, which on a
  CUDA build of torch without a driver raise "Found no NVIDIA driver". EAGLE's draft worker
  calls it at start-up (``speculative/eagle_worker_v2.py`` ``init_lm_head``). Here the same
  method runs with those two calls as no-ops (nothing is cached or in flight on a CPU).
"""

from __future__ import annotations

import contextlib
from unittest import mock

import torch

from sglang_mamba_ext.plugin.speculative.cpu_routing import cpu_spec_active

#: (target, hook type name, function name in this module)
CPU_MTP_HOOK_TARGETS = [
    ("sglang.srt.models.qwen3_next.Qwen3NextForCausalLM.set_embed_and_head", "AROUND", "set_embed_and_head_around"),
    ("sglang.srt.models.nemotron_h.NemotronHForCausalLM.set_embed_and_head", "AROUND", "set_embed_and_head_around"),
]


@contextlib.contextmanager
def _no_cuda_housekeeping():
    """``torch.cuda.empty_cache`` / ``torch.cuda.synchronize`` as no-ops for the block."""
    with mock.patch.object(torch.cuda, "empty_cache", lambda: None), \
            mock.patch.object(torch.cuda, "synchronize", lambda *a, **k: None):
        yield


def set_embed_and_head_around(original, model, *args, **kwargs):
    """AROUND ``set_embed_and_head`` (module docstring): on CPU, SGLang's own method without
    its CUDA cache / sync calls."""
    if not (cpu_spec_active() and not torch.cuda.is_available()):
        return original(model, *args, **kwargs)
    with _no_cuda_housekeeping():
        return original(model, *args, **kwargs)
