"""Request validation under ``--enable-mamba-radix``: prompts that would kill the scheduler.

SGLang 0.5.23 refuses an empty ``input_ids`` list (``managers/io_struct.py``) but not a
``text`` that tokenizes to no token at all (``""`` with a tokenizer that adds no BOS, as the
tiny model's and Qwen's do), and it checks ``token_ids_logprob`` against the vocabulary but
not ``input_ids``: such a request reaches the model (zero tokens, or an embedding lookup out
of range) and the scheduler process dies, taking the server down. Under
``--enable-mamba-radix`` :func:`validate_one_request_before` refuses both in the tokenizer
manager (HTTP 400), before they are scheduled. It also refuses a bad
``mamba_radix.checkpoint_offsets`` action in ``kv_hints`` (:mod:`.chat_boundaries`).
"""

from __future__ import annotations

def validate_one_request_before(tokenizer_manager, obj, input_ids, *args, **kwargs):
    """BEFORE hook on ``TokenizerManager._validate_one_request(obj, input_ids)``.

    Raises:
        ValueError: the prompt has no token, a token id outside ``[0, vocab_size)``, or
            a bad checkpoint-offsets action in ``kv_hints``
            (:func:`.chat_boundaries.validate_request_hints`); SGLang answers HTTP 400.
    """
    from sglang_mamba_ext.plugin.chat_boundaries import validate_request_hints
    from sglang_mamba_ext.plugin.settings import current_settings

    if not current_settings().get("enable"):
        return None
    validate_request_hints(obj, input_ids)
    if input_ids is None or getattr(obj, "input_embeds", None) is not None:
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
