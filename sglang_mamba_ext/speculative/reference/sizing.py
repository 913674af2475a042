"""Bytes of the speculative SSM/conv buffers in snapshot and deferred mode, from model shapes
(``docs/design.md``, "Deferred update"; ``scripts/plan_spec_memory.py``). With ``L`` linear
layers, ``N = max_running_requests``, ``R = N + 1`` rows, ``T = draft_token_num`` and ``A =
steps + 1``: snapshot (SGLang ``memory_pool.py``: ``intermediate_ssm`` + dense
``intermediate_conv_window``) keeps ``L * R * T * (HV*K*V * ssm_bytes + conv_dim*(W-1) *
conv_bytes)`` resident, which is also its peak; deferred keeps only the stash resident, ``L *
R * A * (conv_dim + gate_dim + beta_dim) * act_bytes`` plus 20 bytes of counters per row, and
adds a verify workspace alive from the verify forward to the stash write — pending activations
``L * N * T * (conv_dim + gate_dim + beta_dim) * act_bytes``, one layer's node conv windows ``R
* T * conv_dim*(W-1) * conv_bytes`` and one layer's node SSM states by variant (``one_layer``
``R * T * HV*K*V * ssm_bytes``, ``head_chunk`` ``R * T * head_chunk*K*V * ssm_bytes``,
``on_chip`` 0: ``ops/verify/fused.py`` keeps them in registers); under CUDA graphs that
workspace is activation memory in the graph pool. Mamba2 maps onto the same shape (``x``/``B``/
``C`` of ``xBC`` play ``v``/``k``/``q``: ``H = n_groups``, ``K = d_state``, ``HV = nheads``,
``V = head_dim``; raw gate ``dt``, ``gate_dim = nheads``, no ``beta``). Pure torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from sglang_mamba_ext.models.linear_attn import LinearAttnShape
from sglang_mamba_ext.speculative.stash import ActivationStash, StashDims
from sglang_mamba_ext.speculative.verify_buffers import OneLayerBuffer, SnapshotBuffers

__all__ = ["HybridSpecModel", "MODELS", "SpecMemory", "spec_memory_formula", "spec_memory_measured", "VARIANTS"]

VARIANTS = ("one_layer", "head_chunk", "on_chip")


@dataclass(frozen=True)
class HybridSpecModel:
    """Linear-layer geometry of a hybrid model, from its published ``config.json``.

    Attributes:
        name: model name.
        source: where the numbers come from.
        num_linear_layers: ``L``.
        shape: head layout (Mamba2 mapped as in the module docstring).
        gate_dim / beta_dim: raw gate widths stashed per token.
        kind: ``"kda"``, ``"gdn"`` or ``"mamba2"``.
    """

    name: str
    source: str
    num_linear_layers: int
    shape: LinearAttnShape
    gate_dim: int
    beta_dim: int
    kind: str

    @property
    def stash_dims(self) -> StashDims:
        return StashDims(self.shape.conv_dim, self.gate_dim, self.beta_dim)


def _model(name: str, kind: str, num_linear_layers: int, heads: Tuple[int, int, int, int, int], gate_dim: int,
           beta_dim: int, source: str) -> HybridSpecModel:
    """One :class:`HybridSpecModel`; ``heads`` = ``(H, HV, K, V, W)`` of :class:`LinearAttnShape`."""
    return HybridSpecModel(name, source, num_linear_layers, LinearAttnShape(*heads), gate_dim, beta_dim, kind)


MODELS: Dict[str, HybridSpecModel] = {m.name: m for m in (
    _model("Kimi-Linear-48B-A3B", "kda", 20, (32, 32, 128, 128, 4), 32 * 128, 32, (
        "moonshotai/Kimi-Linear-48B-A3B-Instruct config.json: num_hidden_layers=27, "
        "linear_attn_config={kda_layers: 20 entries [1,2,3,5,6,7,9,10,11,13,14,15,17,18,19,"
        "21,22,23,25,26], full_attn_layers: [4,8,12,16,20,24,27], num_heads: 32, head_dim: "
        "128, short_conv_kernel_size: 4}; KDA q/k/v heads 32 x 128, decay gate f_b output "
        "num_heads*head_dim, beta num_heads. Installed transformers KimiLinearConfig defaults "
        "agree on hidden 2304 / 27 layers / 32 heads / 128 / conv 4."
    )),
    _model("Qwen3-Next-80B-A3B", "gdn", 36, (16, 32, 128, 128, 4), 32, 32, (
        "Qwen/Qwen3-Next-80B-A3B-Instruct config.json: num_hidden_layers=48, "
        "full_attention_interval=4 (36 linear_attention layers), linear_num_key_heads=16, "
        "linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128, "
        "linear_conv_kernel_dim=4; Gated DeltaNet gates a, b: one per value head. Installed "
        "transformers Qwen3NextConfig defaults are the same numbers."
    )),
    _model("Nemotron-H-8B", "mamba2", 24, (8, 128, 128, 64, 4), 128, 0, (
        "nvidia/Nemotron-H-8B-Base-8K config.json: hybrid_override_pattern "
        "'M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-' (24 Mamba2 layers), "
        "mamba_num_heads=128, mamba_head_dim=64, ssm_state_size=128, n_groups=8, "
        "conv_kernel=4 (d_inner 8192, xBC 10240). SGLang's NemotronHConfig defaults "
        "(sglang/srt/configs/nemotron_h.py) are the same pattern and sizes."
    )),
)}


@dataclass
class SpecMemory:
    """Bytes of one configuration (see the module docstring)."""

    snapshot: int
    stash: int
    pending: int
    conv_windows: int
    node_states: Dict[str, int]

    @property
    def deferred_resident(self) -> int:
        return self.stash

    def deferred_peak(self, variant: str) -> int:
        return self.stash + self.pending + self.conv_windows + self.node_states[variant]

    def resident_reduction(self) -> float:
        return self.snapshot / self.deferred_resident

    def peak_reduction(self, variant: str) -> float:
        return self.snapshot / self.deferred_peak(variant)


def _bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _check(topk, steps, draft_token_num, max_running):
    for name, v in (("topk", topk), ("steps", steps), ("draft_token_num", draft_token_num), ("max_running", max_running)):
        if int(v) < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")


def spec_memory_formula(m: HybridSpecModel, topk: int, steps: int, draft_token_num: int, max_running: int,
                        dtype: torch.dtype, ssm_dtype: Optional[torch.dtype] = None, head_chunk: int = 1) -> SpecMemory:
    """Closed-form bytes. ``dtype``: conv state and activations; ``ssm_dtype`` (default
    ``dtype``): SSM state. ``head_chunk``: value heads per pass of the ``head_chunk`` variant
    (rounded up to a multiple of ``HV/H``)."""
    _check(topk, steps, draft_token_num, max_running)
    s, L, T, N = m.shape, m.num_linear_layers, draft_token_num, max_running
    R, A = N + 1, steps + 1
    ab = _bytes(dtype)
    sb = _bytes(ssm_dtype or dtype)
    ssm = s.num_v_heads * s.head_k_dim * s.head_v_dim * sb
    conv = s.conv_dim * (s.conv_kernel - 1) * ab
    per_tok = (m.stash_dims.conv_dim + m.stash_dims.gate_dim + max(m.stash_dims.beta_dim, 1)) * ab
    G = s.num_v_heads // s.num_k_heads
    hc = max(G, -(-head_chunk // G) * G)
    return SpecMemory(
        snapshot=L * R * T * (ssm + conv),
        stash=L * R * A * per_tok + R * 20,
        pending=L * N * T * per_tok,
        conv_windows=R * T * conv,
        node_states={"one_layer": R * T * ssm, "head_chunk": R * T * hc * s.head_k_dim * s.head_v_dim * sb, "on_chip": 0},
    )


def spec_memory_measured(m: HybridSpecModel, topk: int, steps: int, draft_token_num: int, max_running: int,
                         dtype: torch.dtype, ssm_dtype: Optional[torch.dtype] = None, head_chunk: int = 1,
                         reduced_layers: int = 1, reduced_rows: int = 2, reduced_tokens: int = 2) -> SpecMemory:
    """Bytes measured by constructing this project's buffers (:class:`SnapshotBuffers`,
    :class:`OneLayerBuffer`, :class:`ActivationStash`) on CPU at ``reduced_layers`` layers,
    ``reduced_rows`` rows/requests and ``reduced_tokens`` draft tokens (full per-layer shapes),
    then scaling each by its true layer / row / token counts."""
    _check(topk, steps, draft_token_num, max_running)
    s, L, T, N = m.shape, m.num_linear_layers, draft_token_num, max_running
    R, A = N + 1, steps + 1
    sdt = ssm_dtype or dtype
    rl, rr, rt = reduced_layers, reduced_rows, min(reduced_tokens, T)
    G = s.num_v_heads // s.num_k_heads
    hc = max(G, -(-head_chunk // G) * G)

    snap = SnapshotBuffers(rl, rr, rt, s, ssm_dtype=sdt, conv_dtype=dtype)
    snapshot = snap.nbytes() * L * R * T // (rl * rr * rt)
    del snap
    st = ActivationStash(rl, rr, A, m.stash_dims, dtype=dtype)
    rec = sum(t.numel() * t.element_size() for t in (st.mixed_qkv, st.g_raw, st.b_raw))
    counters = (st.nbytes() - rec) // rr
    stash = rec * L * R // (rl * rr) + counters * R
    del st
    pend = ActivationStash(rl, rr, rt, m.stash_dims, dtype=dtype)
    prec = sum(t.numel() * t.element_size() for t in (pend.mixed_qkv, pend.g_raw, pend.b_raw))
    pending = prec * L * N * T // (rl * rr * rt)
    del pend
    one = OneLayerBuffer(rr, rt, s, ssm_dtype=sdt, conv_dtype=dtype)
    one_ssm = one.ssm.numel() * one.ssm.element_size() * R * T // (rr * rt)
    conv_windows = one.conv.numel() * one.conv.element_size() * R * T // (rr * rt)
    del one
    chunk = OneLayerBuffer(rr, rt, s, head_chunk=hc, ssm_dtype=sdt, conv_dtype=dtype)
    chunk_ssm = chunk.ssm.numel() * chunk.ssm.element_size() * R * T // (rr * rt)
    del chunk
    return SpecMemory(snapshot, stash, pending, conv_windows, {"one_layer": one_ssm, "head_chunk": chunk_ssm, "on_chip": 0})
