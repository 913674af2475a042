"""Compressed store for the SSM states the radix tree holds (``docs/design.md``, "int8
checkpoints"): the working states of running requests stay in the full-precision
:class:`~.mamba_pool.MambaPool`; a state entering the tree is quantized once into a slot here
and the active slot is given back; a hit dequantizes it once into the request's fresh working
slot (the copy-on-write). The same split as SGLang 0.5.23's ``--enable-int8-mamba-checkpoint``
(``mem_cache/mamba_checkpoint_pool.py``), whose pool the plugin uses under SGLang
(``plugin/pool.py``); this one is the core's, torch only, for the core's tests and benchmarks.

Quantization: symmetric int8 with one scale per ``(layer, slot, channel)`` where a channel is
every index of the temporal state except ``scale_axis`` (default ``-2``, the axis SGLang's store
reduces over: each (head, last-axis channel) gets its own scale). The conv window is kept at
its own dtype (``W - 1`` tokens; small). The error of one round trip is at most half a
quantization step per entry: ``|x - deq(q(x))| <= amax / 254`` over the reduced axis.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple, Union

import torch

from .mamba_pool import MambaPool, SlotPool, SlotsLike, _as_index, _as_list

#: Largest magnitude of the int8 code (symmetric: -127 .. 127).
QMAX = 127


def quantize_int8(state: torch.Tensor, axis: int = -2) -> Tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 quantization of ``state`` with one scale per slice along ``axis``.

    Args:
        state: float tensor (any float dtype).
        axis: the axis each scale covers (reduced by ``amax``).

    Returns:
        ``(q, scale)``: ``q`` int8 of ``state``'s shape; ``scale`` of ``state``'s dtype and
        shape with ``axis`` of size 1 (computed in float32, then stored in ``state``'s dtype;
        ``q`` is computed against the stored scale, so dequantization uses the same one).
    """
    x = state.float()
    amax = x.abs().amax(dim=axis, keepdim=True)
    scale = (amax / QMAX).clamp_min(torch.finfo(torch.float32).tiny).to(state.dtype)
    q = torch.round(x / scale.float()).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q * scale`` in float32, cast to ``dtype`` (the inverse of :func:`quantize_int8`)."""
    return (q.float() * scale.float()).to(dtype)


def _pair(src_slots: SlotsLike, dst_slots: SlotsLike, device, what: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """The two slot lists of a copy as index tensors.

    Raises:
        ValueError: they differ in length."""
    src, dst = _as_index(src_slots, device), _as_index(dst_slots, device)
    if src.numel() != dst.numel():
        raise ValueError(f"{what}: {src.numel()} sources for {dst.numel()} destinations")
    return src, dst


class Int8CheckpointPool(SlotPool):
    """Slots ``1 .. size`` of int8 SSM states (slot 0 reserved, as in :class:`MambaPool`).

    Tensors (``L`` layers; shapes as the active pool's):

    - ``qdata``: int8 ``[L, size + 1, *temporal_shape]``;
    - ``scale``: ``[L, size + 1, *temporal_shape]`` with ``scale_axis`` of size 1, dtype the
      active pool's temporal dtype;
    - ``conv_state``: ``[L, size + 1, *conv_shape]``, the active pool's conv dtype.

    Args:
        size: slots (states), >= 1.
        active: the full-precision pool whose states this one stores (shapes, dtypes, device).
        scale_axis: axis of the temporal state each scale covers (default ``-2``).

    Raises:
        ValueError: ``size < 1``.
    """

    def __init__(self, size: int, active: MambaPool, scale_axis: int = -2):
        if size < 1:
            raise ValueError(f"Int8CheckpointPool size must be >= 1 slot, got {size}")
        self.size = size
        self.device = active.device
        self.num_layers = active.num_layers
        self.scale_axis = scale_axis
        lead = (active.num_layers, size + 1)
        tshape = tuple(active.temporal_shape)
        sshape = list(tshape)
        sshape[scale_axis] = 1
        self.qdata = torch.zeros(lead + tshape, dtype=torch.int8, device=self.device)
        self.scale = torch.zeros(lead + tuple(sshape), dtype=active.temporal_state.dtype, device=self.device)
        self.conv_state = torch.zeros(lead + tuple(active.conv_shape), dtype=active.conv_state.dtype, device=self.device)
        self.clear_all()

    def slot_bytes(self) -> int:
        """Bytes of one stored state over all layers (int8 data + scales + conv window)."""
        per_layer = sum(math.prod(t.shape[2:]) * t.element_size() for t in (self.qdata, self.scale, self.conv_state))
        return self.num_layers * per_layer

    def total_bytes(self) -> int:
        """Bytes held by the pool's tensors (``size + 1`` slots)."""
        return self.slot_bytes() * (self.size + 1)

    def state_tensors(self):
        """The tensors of a stored state, each ``[L, size + 1, ...]``: ``qdata`` (int8),
        ``scale``, ``conv_state`` (what :class:`HostStatePool` copies for the host tier)."""
        return [self.qdata, self.scale, self.conv_state]

    def store_from_active(self, active: MambaPool, active_slots: SlotsLike, ckpt_slots: SlotsLike) -> None:
        """Quantize the states of ``active_slots`` of ``active`` into ``ckpt_slots`` (a state
        entering the tree).

        Raises:
            ValueError: the two slot lists differ in length."""
        src, dst = _pair(active_slots, ckpt_slots, self.device, "store_from_active")
        q, scale = quantize_int8(active.temporal_state[:, src], self.scale_axis)
        self.qdata[:, dst] = q
        self.scale[:, dst] = scale
        self.conv_state[:, dst] = active.conv_state[:, src]

    def load_to_active(self, active: MambaPool, ckpt_slots: SlotsLike, active_slots: SlotsLike) -> None:
        """Dequantize ``ckpt_slots`` into ``active_slots`` of ``active`` (the copy-on-write of
        a hit).

        Raises:
            ValueError: the two slot lists differ in length."""
        src, dst = _pair(ckpt_slots, active_slots, self.device, "load_to_active")
        active.temporal_state[:, dst] = dequantize_int8(self.qdata[:, src], self.scale[:, src], active.temporal_state.dtype)
        active.conv_state[:, dst] = self.conv_state[:, src]


def int8_slots_at_equal_bytes(active: MambaPool, slots: int, scale_axis: int = -2) -> int:
    """How many int8 states fit in the bytes of ``slots`` full-precision ones of ``active``
    (for sizing and for the benchmark's equal-memory rows)."""
    probe = Int8CheckpointPool(1, active, scale_axis)
    return max(1, (slots * active.slot_bytes()) // probe.slot_bytes())


StatePool = Union[MambaPool, Int8CheckpointPool]


def copy_on_write(active: MambaPool, ckpt: Optional[Int8CheckpointPool], src: SlotsLike, dst: SlotsLike) -> None:
    """The copy-on-write of a hit: ``dst`` (active slots) gets the tree's states ``src`` —
    dequantized from ``ckpt`` when the tree stores int8 states, else copied within
    ``active``."""
    if ckpt is None:
        active.copy_from(src, dst)
    else:
        ckpt.load_to_active(active, src, dst)


class HostStatePool(SlotPool):
    """The host tier of the tree's SSM states (``--enable-hierarchical-cache``;
    ``docs/design.md``, "Host tier"): slots ``1 .. size`` of copies, in host memory, of the
    state tensors of the pool the tree keeps its states in (slot 0 reserved): full precision
    from a :class:`MambaPool`, or int8 data, scales and conv windows as they are from an
    :class:`Int8CheckpointPool` (``--enable-int8-mamba-checkpoint``; about twice the
    states per host byte, no second quantization).

    Tensors: for each state tensor ``t`` of that pool (``[L, S + 1, *shape]``:
    ``active.state_tensors()``, the conv window and the temporal state for
    :class:`MambaPool`) one host tensor ``[size + 1, L, *shape]`` of the same dtype, on the
    CPU (page-locked with ``pin_memory``, for asynchronous copies from a GPU). Slot-major, so
    that one state is one contiguous block of host memory and moves in one DMA transfer each
    way (an indexed gather over a layer-major host tensor is a pageable copy: 3.5 GB/s on an
    H200 against 40+ for the block; ``benchmarks/tiers_gpu.py``).

    Args:
        size: host slots (states), >= 1.
        active: the device pool whose states are copied here (anything with
            ``state_tensors()``: :class:`MambaPool`, :class:`Int8CheckpointPool`, the
            plugin's pools over SGLang's).
        pin_memory: page-locked host memory (only where CUDA is available).

    Raises:
        ValueError: ``size < 1``.
    """

    def __init__(self, size: int, active, pin_memory: bool = False):
        if size < 1:
            raise ValueError(f"HostStatePool size must be >= 1 slot, got {size}")
        self.size = size
        self.device = torch.device("cpu")
        self.host = [
            torch.zeros((size + 1, t.shape[0], *t.shape[2:]), dtype=t.dtype, device="cpu", pin_memory=pin_memory)
            for t in active.state_tensors()
        ]
        self.clear_all()

    def slot_bytes(self) -> int:
        """Bytes of one host state over all layers."""
        return sum(t[0].numel() * t.element_size() for t in self.host)

    def total_bytes(self) -> int:
        """Bytes held by the pool's tensors (``size + 1`` slots)."""
        return self.slot_bytes() * (self.size + 1)

    def layer_major(self, i: int) -> torch.Tensor:
        """Host tensor ``i`` viewed as ``[L, size + 1, *shape]``, the active pool's layout."""
        return self.host[i].transpose(0, 1)

    def store_from_active(self, active, active_slots: SlotsLike, host_slots: SlotsLike) -> None:
        """Copy the states of ``active_slots`` of ``active`` to ``host_slots`` (device to host,
        one block per state and tensor; returns when the copies are done).

        Raises:
            ValueError: the two slot lists differ in length."""
        pairs = _slot_pairs(active_slots, host_slots, "store_from_active")
        for h, t in zip(self.host, active.state_tensors()):
            for a, s in pairs:
                h[s].copy_(t[:, a], non_blocking=t.device.type == "cuda")
        _sync(active)

    def load_to_active(self, active, host_slots: SlotsLike, active_slots: SlotsLike) -> None:
        """Copy ``host_slots`` into ``active_slots`` of ``active`` (host to device, one block
        per state and tensor; returns when the copies are done).

        Raises:
            ValueError: the two slot lists differ in length."""
        pairs = _slot_pairs(host_slots, active_slots, "load_to_active")
        for h, t in zip(self.host, active.state_tensors()):
            for s, a in pairs:
                t[:, a].copy_(h[s], non_blocking=t.device.type == "cuda")
        _sync(active)


def _slot_pairs(src: SlotsLike, dst: SlotsLike, what: str):
    a, b = _as_list(src), _as_list(dst)
    if len(a) != len(b):
        raise ValueError(f"{what}: {len(a)} sources for {len(b)} destinations")
    return list(zip(a, b))


def _sync(active) -> None:
    """Wait for the copies queued on the active pool's device (CUDA) before returning."""
    dev = active.state_tensors()[0].device
    if dev.type == "cuda":
        torch.cuda.current_stream(dev).synchronize()
