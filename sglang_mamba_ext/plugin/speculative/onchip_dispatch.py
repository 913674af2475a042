"""The on-chip verify's stand-in for a KDA / GDN backend's ``kernel_dispatcher`` during one
deferred verify call (``plugin/speculative/hooks.py::_verify_deferred``; ``docs/design.md``,
"Deferred update"): SGLang's verify code runs unchanged and its recurrent ``target_verify`` is
answered by :func:`~sglang_mamba_ext.speculative.verify_onchip.onchip_tree_verify` (its Triton
kernel on CUDA, its torch form on CPU: ``hooks.kernel_impl``)."""

from __future__ import annotations

from sglang_mamba_ext.plugin.speculative.hooks import FLAG, DeferredSpecConfigError, kernel_impl
from sglang_mamba_ext.speculative.deferred import DeferredSpecState
from sglang_mamba_ext.speculative.verify_onchip import onchip_tree_verify

__all__ = ["OnChipDispatcher", "run_onchip"]


class OnChipDispatcher:
    """Stands in for a KDA / GDN backend's ``kernel_dispatcher`` during one on-chip verify
    call: ``target_verify`` (the backend's recurrent verify, after SGLang's own conv kernel
    filled the one-layer conv buffer and ``retrieve_parent_token``) runs
    :func:`~sglang_mamba_ext.speculative.verify_onchip.onchip_tree_verify`; any other attribute
    is the real dispatcher's. ``calls`` counts the on-chip launches."""

    def __init__(self, real, state: DeferredSpecState):
        self._real, self._state, self.calls = real, state, 0

    def __getattr__(self, name):
        return getattr(self._real, name)

    def target_verify(self, A_log, dt_bias, q, k, v, a, b, *, ssm_states, cache_indices, cache_steps,
                      retrieve_parent_token=None, **kwargs):
        if kwargs.get("cache_ring") or kwargs.get("fused_accept_state_indices") is not None:
            raise DeferredSpecConfigError(
                f"{FLAG} deferred: the on-chip verify does not support SGLang's ReplaySSM ring or fused-accept "
                "verify; set SGLANG_MAMBA_EXT_DEFERRED_VERIFY=one_layer"
            )
        st = self._state
        self.calls += 1
        return onchip_tree_verify(q, k, v, a, b, A_log, dt_bias, ssm_states, cache_indices, cache_steps,
                                  retrieve_parent_token, st.max_depth, st.layout.per_head_gate, ssm_vk=st.layout.ssm_vk,
                                  impl=kernel_impl(q))


def run_onchip(backend, state: DeferredSpecState, run):
    """``run()`` SGLang's verify with :class:`OnChipDispatcher` as the backend's dispatcher
    (and KDA's fused chain-verify kernel, which writes node states itself, off for the call).

    Raises:
        RuntimeError: SGLang's verify took a path that did not call ``target_verify`` once."""
    real = backend.kernel_dispatcher
    fused = getattr(backend, "_fused_chain_verify_fn", None)
    proxy = OnChipDispatcher(real, state)
    backend.kernel_dispatcher = proxy
    if fused is not None:
        backend._fused_chain_verify_fn = None
    try:
        out = run()
    finally:
        backend.kernel_dispatcher = real
        if fused is not None:
            backend._fused_chain_verify_fn = fused
    if proxy.calls != 1:
        raise RuntimeError(f"{FLAG} deferred: on-chip verify expected one target_verify call, SGLang made {proxy.calls}")
    return out
