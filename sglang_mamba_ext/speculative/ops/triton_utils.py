"""Triton pieces shared by the replay and verify kernels: the gated-delta-rule step on a state
tile, softplus, and launching a kernel in the mode it was built for. ``@triton.jit`` picks
compiled or interpreted mode from ``TRITON_INTERPRET`` when a module is imported, and the
interpreter reads the variable again while a kernel runs (a helper ``@triton.jit`` function
called from an interpreted kernel fails with "Cannot call @triton.jit'd outside of the scope of
a kernel" without it), so :func:`launch_scope` sets ``TRITON_INTERPRET=1`` for a launch exactly
when the kernel was built for the interpreter (CPU tests) and does nothing on CUDA. The step is
the recurrence of ``docs/design.md``, "Tiny hybrid model" (torch:
``models/linear_attn.py::gated_delta_rule_step``).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

import triton
import triton.language as tl

__all__ = ["gated_delta_step", "softplus", "silu_l2_kv", "raw_decay_beta", "is_interpreted", "interpreter_env",
           "launch_scope"]


# One gated-delta-rule token on a [BK, BV] float32 state tile: S * decay, then
# S + k (beta * (v - S^T k))^T. k [BK] and v [BV] float32 (masked lanes zero), decay = exp(g)
# broadcastable to the tile ([BK, 1] per key channel, or a scalar per head), beta a scalar.
# Returns the new tile.
@triton.jit
def gated_delta_step(S, k, v, decay, beta):
    S = S * decay
    pred = tl.sum(k[:, None] * S, axis=0)
    return S + k[:, None] * ((v - pred) * beta)[None, :]


# torch.nn.functional.softplus (beta=1, threshold=20), elementwise.
@triton.jit
def softplus(x):
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))


# In-chunk writers: the causal depthwise conv's output (bias added, before the activation),
# float32, for channel lanes ch at token t of a row whose inputs start at row tok0 of in_ptr
# ([*, D]): input column m = t + j (j < W) of [start window (W-1 columns at conv_base, strides
# s_cd / s_cw; zeros without has_src), tokens]; taps at cw_base ([D, W]), bias at cb_base.
@triton.jit
def conv_at(conv_base, s_cd, s_cw, in_ptr, tok0, cw_base, cb_base, ch, mask, t, has_src,
            D: tl.constexpr, W: tl.constexpr, HAS_BIAS: tl.constexpr):
    y = tl.zeros(ch.shape, dtype=tl.float32)
    for j in tl.static_range(W):
        m = t + j
        old = m < W - 1
        tok = in_ptr + (tok0 + tl.maximum(m - (W - 1), 0)) * D
        x = tl.load(conv_base + ch * s_cd + tl.minimum(m, W - 2) * s_cw, mask=mask & old & has_src,
                    other=0.0).to(tl.float32) + tl.load(tok + ch, mask=mask & (m >= W - 1), other=0.0).to(tl.float32)
        y += tl.load(cw_base + ch * W + j, mask=mask, other=0.0).to(tl.float32) * x
    if HAS_BIAS:
        y += tl.load(cb_base + ch, mask=mask, other=0.0).to(tl.float32)
    return y


# One token of a Mamba2 layer on a [BP, N] state tile S (head i_h's x channels cx, its group's
# B channels cB, masks mp / mn), from raw inputs at row tok0 of in_ptr and token t: conv + bias
# (conv_at), SiLU rounded to act_ty as served, dt = clamp(softplus(dt_raw + dtb)), then
# S = exp(dt * a) * S + (dt * x) (outer) B. Shared by the Mamba2 in-chunk writer and replay.
@triton.jit
def mamba2_token_step(S, conv_base, s_cd, s_cw, in_ptr, tok0, cw_base, cb_base, cx, cB, mp, mn, t, has_src,
                      dt_tok_ptr, a, dtb, DT_MIN, DT_MAX, act_ty: tl.constexpr,
                      D: tl.constexpr, W: tl.constexpr, HAS_BIAS: tl.constexpr):
    yx = conv_at(conv_base, s_cd, s_cw, in_ptr, tok0, cw_base, cb_base, cx, mp, t, has_src, D, W, HAS_BIAS)
    yb = conv_at(conv_base, s_cd, s_cw, in_ptr, tok0, cw_base, cb_base, cB, mn, t, has_src, D, W, HAS_BIAS)
    yx = (yx / (1.0 + tl.exp(-yx))).to(act_ty).to(tl.float32)
    yb = (yb / (1.0 + tl.exp(-yb))).to(act_ty).to(tl.float32)
    dt = tl.minimum(tl.maximum(softplus(tl.load(dt_tok_ptr).to(tl.float32) + dtb), DT_MIN), DT_MAX)
    return S * tl.exp(dt * a) + (dt * yx)[:, None] * yb[None, :]


# In-chunk writers (ops/inchunk): the deepest of request i_n's C planned offsets (-1: none).
@triton.jit
def deepest_offset(offs_ptr, i_n, C: tl.constexpr):
    n = tl.load(offs_ptr + i_n * C)
    for j in tl.static_range(1, C):
        n = tl.maximum(n, tl.load(offs_ptr + i_n * C + j))
    return n


# In-chunk writers: store the state tile S (cast to the pool's dtype) into every destination
# slot of request i_n whose planned offset is t (pads -1 skipped); base points at the layer and
# head, s_slot is the pool's slot stride, tile the tile's element offsets, mask its lanes.
@triton.jit
def store_at_offset(base, s_slot, tile, S, offs_ptr, dst_ptr, i_n, t, mask, C: tl.constexpr):
    for j in tl.static_range(C):
        o = tl.load(offs_ptr + i_n * C + j)
        d = tl.load(dst_ptr + i_n * C + j)
        tl.store(base + tl.maximum(d, 0) * s_slot + tile, S.to(base.dtype.element_ty), mask=mask & (o == t) & (d >= 0))


def is_interpreted(kernel: Any) -> bool:
    """Whether ``kernel`` was decorated under ``TRITON_INTERPRET=1``."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover - very old Triton
        return False
    return isinstance(kernel, InterpretedFunction)


@contextlib.contextmanager
def interpreter_env() -> Iterator[None]:
    """``TRITON_INTERPRET=1`` while inside; the previous value is restored on exit."""
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old


def launch_scope(kernel: Any) -> "contextlib.AbstractContextManager[None]":
    """Context for launching ``kernel``: :func:`interpreter_env` if the kernel is
    interpreted, else nothing."""
    return interpreter_env() if is_interpreted(kernel) else contextlib.nullcontext()


# One token's key and value from their conv outputs (float32 ``yk [BK]``, ``yv [BV]``, before
# the activation): SiLU, the forward's rounding to the activation dtype ``act_ty``, per-head L2
# norm of k (masked lanes ``mk`` zero). Shared by the replay and in-chunk checkpoint kernels.
@triton.jit
def silu_l2_kv(yk, yv, mk, act_ty: tl.constexpr, EPS: tl.constexpr):
    yk = (yk * tl.sigmoid(yk)).to(act_ty).to(tl.float32)
    yv = (yv * tl.sigmoid(yv)).to(act_ty).to(tl.float32)
    yk = tl.where(mk, yk, 0.0)
    kn = (yk * (1.0 / tl.sqrt(tl.sum(yk * yk, axis=0) + EPS))).to(act_ty).to(tl.float32)
    return kn, yv


# One token's activated decay and beta for value head ``i_hv`` from the raw gates:
# ``decay = exp(-exp(A_log) * softplus(g_raw + dt_bias))``, per key channel (KDA: ``[BK, 1]``,
# ``g_tok`` / ``dtb`` rows of ``HV*K``) or one per value head (GDN, ``PER_HEAD_GATE``: a scalar,
# rows of ``HV``); ``beta = sigmoid(b_raw)``. ``neg_a = -exp(A_log[i_hv])``.
@triton.jit
def raw_decay_beta(g_tok, b_tok, dtb, neg_a, i_hv, offs_k, mk, K: tl.constexpr, PER_HEAD_GATE: tl.constexpr):
    if PER_HEAD_GATE:
        graw = tl.load(g_tok + i_hv).to(tl.float32)
        decay = tl.exp(neg_a * softplus(graw + tl.load(dtb + i_hv).to(tl.float32)))
    else:
        graw = tl.load(g_tok + i_hv * K + offs_k, mask=mk, other=0.0).to(tl.float32)
        bias = tl.load(dtb + i_hv * K + offs_k, mask=mk, other=0.0).to(tl.float32)
        decay = tl.exp(neg_a * softplus(graw + bias))[:, None]
    beta = tl.sigmoid(tl.load(b_tok + i_hv).to(tl.float32))
    return decay, beta
