"""CPU compatibility of SGLang 0.5.23's extra_buffer checkpoint tracking.

``ScheduleBatch.prepare_for_decode`` (``managers/schedule_batch.py``, extra_buffer branch)
moves the decode track mask to the device with ``track_mask_cpu.pin_memory().to(...)``.
Pinning needs a CUDA driver: on a host without one it raises, so SGLang's tracking pipeline
cannot run on CPU-only hosts (SGLang itself never runs extra_buffer there). Every other
pinned copy in that pipeline asks ``is_pin_memory_available()`` first.

:func:`prepare_for_decode_around` (an AROUND hook) makes ``Tensor.pin_memory`` return the
tensor unchanged for the duration of that one call, only under ``--enable-mamba-radix`` on a
host where pinning is impossible (``torch.cuda.is_available()`` is False); elsewhere it calls
the method untouched. Pinning is only a transfer optimization, so the result is the same.
"""

from __future__ import annotations

import contextlib

import torch

from sglang_mamba_ext.sglang.settings import BACKEND_NAME


@contextlib.contextmanager
def _pin_memory_is_identity():
    original = torch.Tensor.pin_memory

    def _identity(self, *args, **kwargs):
        return self

    torch.Tensor.pin_memory = _identity
    try:
        yield
    finally:
        torch.Tensor.pin_memory = original


def _needs_no_pin() -> bool:
    if torch.cuda.is_available():
        return False
    from sglang.srt.runtime_context import get_exec, get_memory

    return get_memory().radix_cache_backend == BACKEND_NAME and bool(get_exec().mamba.enable_mamba_extra_buffer)


def prepare_for_decode_around(original, batch, *args, **kwargs):
    """AROUND hook on ``ScheduleBatch.prepare_for_decode`` (module docstring)."""
    if not _needs_no_pin():
        return original(batch, *args, **kwargs)
    with _pin_memory_is_identity():
        return original(batch, *args, **kwargs)


# -- prompts that would kill the scheduler ------------------------------------------------
#
# SGLang 0.5.23 refuses an empty ``input_ids`` list (``managers/io_struct.py``) but not a
# ``text`` that tokenizes to no token at all (``""`` with a tokenizer that adds no BOS, as the
# tiny model's and Qwen's do), and it checks ``token_ids_logprob`` against the vocabulary but
# not ``input_ids``: such a request reaches the model (zero tokens, or an embedding lookup
# out of range) and the scheduler process dies, taking the server down. Under
# ``--enable-mamba-radix`` the check below refuses both in the tokenizer manager (HTTP 400),
# before they are scheduled.


def validate_one_request_before(tokenizer_manager, obj, input_ids, *args, **kwargs):
    """BEFORE hook on ``TokenizerManager._validate_one_request(obj, input_ids)``.

    Raises:
        ValueError: the prompt has no token, or a token id outside ``[0, vocab_size)``
            (turned into an HTTP 400 by SGLang).
    """
    from sglang_mamba_ext.sglang.settings import current_settings

    if input_ids is None or getattr(obj, "input_embeds", None) is not None:
        return None
    if not current_settings().get("enable"):
        return None
    if len(input_ids) == 0:
        raise ValueError("the prompt is empty: it has no token after tokenization; send at least one token")
    vocab = getattr(getattr(tokenizer_manager, "model_config", None), "vocab_size", None)
    if vocab and isinstance(input_ids[0], int):
        lo, hi = min(input_ids), max(input_ids)
        if lo < 0 or hi >= vocab:
            bad = lo if lo < 0 else hi
            raise ValueError(
                f"input_ids contains out-of-vocabulary token id {bad}; valid range is [0, {vocab})"
            )
    return None
