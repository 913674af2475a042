"""SSM-state pool (``docs/design.md``, "Copy-on-write"): one slot = the conv window and the recurrent
(temporal) state of every linear-attention layer.

Mirrors the layout of SGLang's ``MambaPool`` (``sglang/srt/mem_cache/memory_pool.py``) so the
same tensors can be read by SGLang's linear-attention backends.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple, Union

import torch

SlotsLike = Union[torch.Tensor, Sequence[int], int]


def _as_index(slots: SlotsLike, device: torch.device) -> torch.Tensor:
    if isinstance(slots, torch.Tensor):
        return slots.to(device=device, dtype=torch.int64).reshape(-1)
    if isinstance(slots, int):
        return torch.tensor([slots], dtype=torch.int64, device=device)
    return torch.tensor(list(slots), dtype=torch.int64, device=device)


def _as_list(slots: SlotsLike) -> List[int]:
    if isinstance(slots, torch.Tensor):
        return slots.reshape(-1).tolist()
    if isinstance(slots, int):
        return [slots]
    return [int(s) for s in slots]


class SlotPool:
    """A free list of slots ``1 .. size`` (slot ``0`` is never handed out): the allocation half
    of :class:`MambaPool` and of :class:`~.checkpoint_pool.Int8CheckpointPool`. Subclasses set
    ``size`` and ``device`` and call :meth:`clear_all`; sizes are in slots."""

    size: int
    device: torch.device

    def available_size(self) -> int:
        """Free slots."""
        return len(self._free)

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        """Take ``need_size`` slots.

        Returns:
            int64 tensor ``[need_size]`` of slot ids, or ``None`` if fewer are free (nothing
            is taken then). The slots' contents are not cleared.
        """
        slots = self.alloc_list(need_size)
        if slots is None:
            return None
        return torch.tensor(slots, dtype=torch.int64, device=self.device)

    def alloc_list(self, need_size: int) -> Optional[List[int]]:
        """Like :meth:`alloc` but returns a Python list (the scheduler hot path)."""
        if need_size < 0:
            raise ValueError(f"alloc({need_size}): size must be >= 0")
        free = self._free
        if need_size > len(free):
            return None
        out = free[len(free) - need_size :] if need_size else []
        del free[len(free) - need_size :]
        out.reverse()
        is_free = self._is_free
        for s in out:
            is_free[s] = 0
        return out

    def free(self, slots: SlotsLike) -> None:
        """Return slots to the pool.

        Raises:
            ValueError: if a slot is out of range or already free (double free).
        """
        lst = _as_list(slots)
        is_free = self._is_free
        for s in lst:
            if s < 1 or s > self.size:
                raise ValueError(f"{type(self).__name__}.free: slot {s} out of range [1, {self.size}]")
            if is_free[s]:
                raise ValueError(f"{type(self).__name__}.free: slot {s} is already free (double free)")
            is_free[s] = 1
        self._free.extend(lst)

    def is_free(self, slot: int) -> bool:
        """Whether allocatable slot ``slot`` is on the free list."""
        return bool(self._is_free[slot])

    def free_slots(self) -> List[int]:
        """Sorted free slots (for leak checks and tests)."""
        return sorted(self._free)

    def clear_all(self) -> None:
        """Free every slot (server flush); contents are left as they are."""
        # LIFO stack of free slots (slot 1 handed out first); ``_is_free`` catches double
        # frees and never marks slot 0 free.
        self._free = list(range(self.size, 0, -1))
        self._is_free = bytearray(b"\x00") + bytearray(b"\x01") * self.size


class MambaPool(SlotPool):
    """Pool of SSM-state slots.

    Tensors (``L`` = number of linear-attention layers):

    - ``conv_state``: ``[L, size + 1, *conv_shape]`` (``conv_shape`` is ``(dim, W - 1)``,
      window axis last, as SGLang's ``Mamba2StateShape.conv``), dtype ``conv_dtype``.
    - ``temporal_state``: ``[L, size + 1, *temporal_shape]`` (``(HV, K, V)`` for a
      gated-delta-rule layer), dtype ``dtype``.

    Slots ``1 .. size`` are allocatable; slot ``0`` is a padding slot that dummy rows of a
    padded batch may write to (never handed out) — SGLang's convention
    (``sglang/srt/mem_cache/allocator/mamba.py``), so the same tensors can back both.

    Args:
        size: allocatable slots (states). Must be >= 1.
        num_layers: linear-attention layers ``L`` (>= 1).
        conv_shape: per-layer conv-window shape, e.g. ``(conv_dim, W - 1)``.
        temporal_shape: per-layer recurrent-state shape, e.g. ``(HV, K, V)``.
        dtype: dtype of ``temporal_state`` (default float32).
        conv_dtype: dtype of ``conv_state`` (default: ``dtype``).
        device: tensor device.
        conv_state / temporal_state: existing tensors to use instead of allocating (e.g.
            SGLang's ``MambaPool.mamba_cache.conv[0]`` / ``.temporal``); their shapes must be
            ``[num_layers, size + 1, *shape]``.

    Raises:
        ValueError: on a non-positive size or layer count, an empty shape, or given tensors
            of the wrong shape.
    """

    def __init__(
        self,
        size: int,
        num_layers: int,
        conv_shape: Tuple[int, ...],
        temporal_shape: Tuple[int, ...],
        dtype: torch.dtype = torch.float32,
        conv_dtype: Optional[torch.dtype] = None,
        device: Union[str, torch.device] = "cpu",
        conv_state: Optional[torch.Tensor] = None,
        temporal_state: Optional[torch.Tensor] = None,
    ):
        if size < 1:
            raise ValueError(f"MambaPool size must be >= 1 slot, got {size}")
        if num_layers < 1:
            raise ValueError(f"MambaPool needs >= 1 linear-attention layer, got {num_layers}")
        if not conv_shape or not temporal_shape:
            raise ValueError("MambaPool conv_shape and temporal_shape must be non-empty")
        self.size = size
        self.num_layers = num_layers
        self.conv_shape = tuple(int(d) for d in conv_shape)
        self.temporal_shape = tuple(int(d) for d in temporal_shape)
        self.dtype = dtype
        self.conv_dtype = conv_dtype or dtype
        self.device = torch.device(device)
        for name, given, shape in (
            ("conv_state", conv_state, self.conv_shape),
            ("temporal_state", temporal_state, self.temporal_shape),
        ):
            if given is not None and tuple(given.shape) != (num_layers, size + 1, *shape):
                raise ValueError(
                    f"MambaPool: {name} has shape {tuple(given.shape)}, expected "
                    f"{(num_layers, size + 1, *shape)}"
                )
        if conv_state is None:
            conv_state = torch.zeros(
                (num_layers, size + 1, *self.conv_shape), dtype=self.conv_dtype, device=self.device
            )
        if temporal_state is None:
            temporal_state = torch.zeros(
                (num_layers, size + 1, *self.temporal_shape), dtype=self.dtype, device=self.device
            )
        self.conv_state = conv_state
        self.temporal_state = temporal_state
        self.conv_dtype = conv_state.dtype
        self.dtype = temporal_state.dtype
        self.padding_slot = 0
        self.clear_all()

    # -- sizes ------------------------------------------------------------------------
    def slot_bytes(self) -> int:
        """Bytes of one slot over all layers (conv window + temporal state)."""
        conv = math.prod(self.conv_shape) * self.conv_state.element_size()
        temporal = math.prod(self.temporal_shape) * self.temporal_state.element_size()
        return self.num_layers * (conv + temporal)

    def total_bytes(self) -> int:
        """Bytes held by the pool's tensors (``size + 1`` slots)."""
        return self.slot_bytes() * (self.size + 1)

    # -- data movement ----------------------------------------------------------------
    def copy_from(self, src_slots: SlotsLike, dst_slots: SlotsLike) -> None:
        """``state[:, dst] = state[:, src]`` for conv and temporal state, every layer
        (the copy-on-write, ``docs/design.md``). One gather/scatter per tensor for the whole batch."""
        src = _as_index(src_slots, self.device)
        dst = _as_index(dst_slots, self.device)
        if src.numel() != dst.numel():
            raise ValueError(f"copy_from: {src.numel()} sources for {dst.numel()} destinations")
        if src.numel() == 0:
            return
        self.conv_state[:, dst] = self.conv_state[:, src]
        self.temporal_state[:, dst] = self.temporal_state[:, src]

    def clear(self, slots: SlotsLike) -> None:
        """Zero the states of ``slots`` (a request starting from an empty prefix)."""
        idx = _as_index(slots, self.device)
        if idx.numel() == 0:
            return
        self.conv_state[:, idx] = 0
        self.temporal_state[:, idx] = 0

    def state_tensors(self) -> List[torch.Tensor]:
        """Every tensor holding a slot's state, each ``[L, size + 1, ...]`` (what a copy of
        a state to another tier must take)."""
        return [self.conv_state, self.temporal_state]

    def layer_cache(self, layer: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Views ``(conv_state[layer], temporal_state[layer])``: ``[size+1, *conv_shape]``
        and ``[size+1, *temporal_shape]``, for a forward pass of linear layer ``layer``
        (0-based among linear layers)."""
        return self.conv_state[layer], self.temporal_state[layer]
