"""SGLang glue of the deferred verify for Mamba2 targets (issue 41, item 3): Nemotron-H,
Falcon-H1, GraniteMoeHybrid, whose linear layers are SGLang's ``MambaMixer2``
(``srt/layers/attention/mamba/mamba.py``) run by ``Mamba2AttnBackend.forward``
(``srt/layers/attention/hybrid_linear_attn_backend.py``).

In a target-verify batch SGLang's mixer runs its verify conv (``causal_conv1d_update`` with
``intermediate_conv_window``, which also rolls the main window in place) and its
``selective_state_update`` with ``disable_state_update=True`` and the node states written into
``intermediate_ssm`` (here the one-layer buffer seen as ``L`` layers, stride 0:
:func:`.hooks.mamba_pool_init_around`). :func:`mamba2_forward_around` (AROUND
``Mamba2AttnBackend.forward``) adds, for such a batch in deferred mode:

- the capture: a forward hook on the mixer's ``in_proj`` (registered once per mixer, inert
  outside the call) copies every node's raw ``xBC`` (``[n, conv_dim]``, before the conv) and raw
  ``dt`` (``[n, HV]``, before ``dt_bias`` and softplus) into the pending workspace, and the
  layer's replay weights are registered (``conv1d.weight``, ``conv1d.bias``, ``A`` =
  ``-exp(A_log)``, ``dt_bias``); ``mup_vector`` (Falcon-H1) is applied as the mixer applies it;
- the batch's main conv windows of the layer, saved before and restored after, so the main
  state stays at the last committed token until the next round's replay
  (:mod:`sglang_mamba_ext.speculative.ops.replay.mamba2`).

- the node states: where the pool has no node-state buffer (``verify_variant=on_chip``, the
  on-chip rule of :mod:`sglang_mamba_ext.speculative.verify_onchip` with ``K`` = d_state and
  ``V`` = head_dim), :func:`ssu_around` (AROUND SGLang's ``selective_state_update`` dispatcher,
  ``kernels/ops/mamba/triton_ops/ssu_dispatch.py``) answers the mixer's verify call with
  :func:`~sglang_mamba_ext.speculative.ops.verify.mamba2_onchip.mamba2_tree_verify_triton`
  (each node's state recomputed along its path in registers, same outputs; on CPU its torch
  reference, ``hooks.kernel_impl``); otherwise SGLang's
  kernel fills the one-layer buffer.

Commit, replay and release are the shared hooks of :mod:`.hooks`.

Raises (at the first verify): :class:`.hooks.DeferredSpecConfigError` for a mixer whose
activation is not SiLU or whose ``in_proj`` output does not split as SGLang's ``MambaMixer2``
splits it, or (on chip) a verify call with a gate ``z`` or with state updates on.
"""

from __future__ import annotations

import inspect
import threading
from typing import Optional

import torch

from sglang_mamba_ext.plugin.speculative import hooks
from sglang_mamba_ext.speculative.verify_onchip import VERIFY_ENV

__all__ = ["MAMBA2_CONFIG_CLASSES", "is_mamba2_target", "layout_for", "mamba2_forward_around", "ssu_around"]

#: SGLang config classes whose linear layers are ``MambaMixer2`` (``configs/hybrid_arch.py::
#: mamba2_config`` also answers for LFM2's short conv, Zaya's CCA and Mamba1, which are not).
MAMBA2_CONFIG_CLASSES = frozenset({
    "NemotronHConfig", "NemotronHPuzzleConfig", "FalconH1Config", "GraniteMoeHybridConfig", "Mamba2Config",
})
_HOOK_ATTR = "_mamba_ext_deferred_capture"  # the in_proj forward hook's handle, on the mixer
_local = threading.local()
_signature = None
_ssu_signature = None


def is_mamba2_target(model_config) -> bool:
    """Whether a SGLang ``ModelConfig``'s linear layers are Mamba2 mixers (:data:`MAMBA2_CONFIG_CLASSES`)."""
    from sglang.srt.configs.hybrid_arch import mamba2_config

    cfg = mamba2_config(model_config)
    return cfg is not None and type(cfg).__name__ in MAMBA2_CONFIG_CLASSES


def _split_sizes(mixer):
    tp = mixer.tp_size
    return mixer.intermediate_size // tp, mixer.conv_dim // tp, mixer.num_heads // tp


def _capture(mixer, output) -> None:
    """``mixer.in_proj``'s forward hook: during a deferred verify call of this mixer, capture."""
    ctx = getattr(_local, "ctx", None)
    if ctx is None or ctx["mixer"] is not mixer:
        return None
    projected = output[0] if isinstance(output, tuple) else output
    mup = ctx["mup_vector"]
    if mup is not None:
        projected = projected * mup
    i_sz, d_sz, h_sz = _split_sizes(mixer)
    if projected.shape[-1] != i_sz + d_sz + h_sz:
        raise hooks.DeferredSpecConfigError(
            f"{hooks.FLAG} deferred: {type(mixer).__name__}'s in_proj gives {projected.shape[-1]} columns, "
            f"not gate {i_sz} + xBC {d_sz} + dt {h_sz}"
        )
    n = ctx["n_tokens"]
    xbc = projected[:n, i_sz:i_sz + d_sz]
    dt = projected[:n, i_sz + d_sz:]
    hooks.capture_verify_inputs(ctx["rtp"], ctx["layer_id"], mixer.conv1d.weight, mixer.conv1d.bias, mixer.A,
                                mixer.dt_bias, xbc, dt, None)
    ctx["captured"] = True


def _ensure_hook(mixer) -> None:
    if getattr(mixer, _HOOK_ATTR, None) is None:
        if getattr(mixer, "activation", "silu") != "silu":
            raise hooks.DeferredSpecConfigError(
                f"{hooks.FLAG} deferred: Mamba2 replay applies SiLU after the conv; this mixer uses {mixer.activation!r}"
            )
        handle = mixer.in_proj.register_forward_hook(lambda _mod, _inp, out, mixer=mixer: _capture(mixer, out))
        setattr(mixer, _HOOK_ATTR, handle)


def mamba2_forward_around(original, backend, *args, **kwargs):
    """AROUND ``Mamba2AttnBackend.forward(mixer, hidden_states, output, layer_id, forward_batch,
    mup_vector=None, use_triton_causal_conv=False)``: SGLang's call, with the capture and the
    saved main conv windows of the module docstring for a target-verify batch in deferred
    mode. Returns what SGLang returns.

    Raises:
        hooks.DeferredSpecConfigError: see the module docstring; RuntimeError if SGLang's verify
            never ran the mixer's ``in_proj`` (nothing captured).
    """
    rtp = getattr(backend, "req_to_token_pool", None)
    state = hooks._state_of(rtp)
    if state is None:
        return original(backend, *args, **kwargs)
    global _signature
    if _signature is None:
        _signature = inspect.signature(original)
    bound = _signature.bind(backend, *args, **kwargs)
    forward_batch = bound.arguments["forward_batch"]
    if not forward_batch.forward_mode.is_target_verify():
        return original(backend, *args, **kwargs)
    mixer, layer_id = bound.arguments["mixer"], bound.arguments["layer_id"]
    spec_info = forward_batch.spec_info
    if getattr(spec_info, "ragged_verify_layout", None) is not None:
        raise hooks.DeferredSpecConfigError(f"{hooks.FLAG} deferred: ragged verify layouts are not supported")
    _ensure_hook(mixer)
    bs = forward_batch.batch_size
    idx = backend.forward_metadata.mamba_cache_indices[:bs].to(torch.int64).clamp(min=0)
    conv = rtp.mamba2_layer_cache(layer_id).conv[0]
    saved = conv.index_select(0, idx)
    _local.ctx = dict(mixer=mixer, rtp=rtp, layer_id=layer_id, mup_vector=bound.arguments.get("mup_vector"),
                      n_tokens=bs * spec_info.draft_token_num, captured=False,
                      onchip_depth=state.max_depth if state.on_chip else None, onchip_calls=0)
    try:
        out = original(backend, *args, **kwargs)
        ctx = _local.ctx
    finally:
        _local.ctx = None
    if not ctx["captured"]:
        raise RuntimeError(f"{hooks.FLAG} deferred: Mamba2 verify of layer {layer_id} ran no in_proj to capture")
    if state.on_chip and ctx["onchip_calls"] != 1:
        raise RuntimeError(f"{hooks.FLAG} deferred: on-chip Mamba2 verify of layer {layer_id} expected one "
                           f"selective_state_update verify call, SGLang made {ctx['onchip_calls']}")
    conv.index_copy_(0, idx, saved)
    return out


def layout_for(configurator) -> Optional[str]:
    """``"mamba2"`` for a target whose linear layers are Mamba2 mixers, else None."""
    mc = getattr(configurator, "model_config", None)
    return "mamba2" if mc is not None and is_mamba2_target(mc) else None


def ssu_around(original, *args, **kwargs):
    """AROUND SGLang's ``selective_state_update`` dispatcher: inside an on-chip deferred verify
    of a Mamba2 layer (:func:`mamba2_forward_around`), the verify call (one with
    ``intermediate_states_buffer``) runs the on-chip tree verify into SGLang's ``out`` instead;
    every other call is SGLang's.

    Raises:
        hooks.DeferredSpecConfigError: a gate ``z`` or ``disable_state_update=False`` in that call.
    """
    ctx = getattr(_local, "ctx", None)
    if ctx is None or ctx["onchip_depth"] is None or kwargs.get("intermediate_states_buffer") is None:
        return original(*args, **kwargs)
    global _ssu_signature
    if _ssu_signature is None:
        _ssu_signature = inspect.signature(original)
    a = _ssu_signature.bind(*args, **kwargs).arguments
    if a.get("z") is not None or not a.get("disable_state_update", False):
        raise hooks.DeferredSpecConfigError(
            f"{hooks.FLAG} deferred: the on-chip Mamba2 verify takes no gate z and never updates the state; "
            f"set {VERIFY_ENV}=one_layer"
        )
    from sglang_mamba_ext.speculative.ops.verify.mamba2_onchip import mamba2_tree_verify

    out = a["out"]
    y = mamba2_tree_verify(a["state"], a["x"], a["dt"], a["A"], a["B"], a["C"], a.get("D"), a.get("dt_bias"),
                           a["state_batch_indices"], a.get("retrieve_parent_token"), ctx["onchip_depth"],
                           dt_softplus=a.get("dt_softplus", False), out=out, impl=hooks.kernel_impl(out))
    if y is not out:  # the torch form (CPU) returns a new float32 tensor
        out[: y.shape[0]].copy_(y.to(out.dtype))
    ctx["onchip_calls"] += 1
    return None
