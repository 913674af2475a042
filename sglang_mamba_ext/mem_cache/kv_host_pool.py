"""The host tier of attention KV (``--enable-hierarchical-cache``; ``docs/design.md``, "Host
tier"): host-memory copies of the KV of tree nodes the device KV pool gave up. A node's KV
is in exactly one place — device slots (``TreeNode.value``) or slots of this pool
(``TreeNode.host_value``); the copies happen inside the cache's calls (demotion at KV
eviction, load back at a copy-on-write match).

SGLang's own ``MHATokenToKVPoolHost`` (``mem_cache/pool_host/mha.py``) moves KV through
``sgl_kernel``'s transfer kernels, which a host without CUDA does not have; this pool copies
with torch indexing, one gather per layer buffer, and works on any device.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .allocator import KVSlotAllocator


class HostKVPool:
    """Host slots for KV tokens, handed out in pages like the device pool.

    Args:
        size: host KV slots (tokens), a positive multiple of ``page_size``.
        page_size: tokens per page (the device pool's).
        device_buffers: the device KV pool's buffers, one tensor per layer and per K / V,
            each ``[device slots + page_size, *token_shape]`` (SGLang's ``k_buffer[i]`` /
            ``v_buffer[i]``; an MLA pool's ``kv_buffer[i]``), indexed by device slot. Empty:
            slots are accounted but no data moves (the core's tests and benchmarks).
        pin_memory: page-locked host buffers (only where CUDA is available).

    Raises:
        ValueError: a size that is not a positive multiple of ``page_size``.
    """

    def __init__(
        self,
        size: int,
        page_size: int = 1,
        device_buffers: Sequence[torch.Tensor] = (),
        pin_memory: bool = False,
    ):
        self._slots = KVSlotAllocator(size, page_size)
        self.size = size
        self.page_size = page_size
        self.device_buffers = list(device_buffers)
        self.host_buffers = [
            torch.zeros((size + page_size, *b.shape[1:]), dtype=b.dtype, device="cpu", pin_memory=pin_memory)
            for b in self.device_buffers
        ]

    @property
    def logical_size(self) -> int:
        """Tokens the pool can hold (SGLang's host-pool metrics read this name)."""
        return self.size

    def token_bytes(self) -> int:
        """Bytes of one token's KV over all buffers (0 without buffers)."""
        return sum(b[0].numel() * b.element_size() for b in self.host_buffers)

    def total_bytes(self) -> int:
        """Bytes held by the host buffers."""
        return self.token_bytes() * (self.size + self.page_size)

    def available_size(self) -> int:
        """Free host slots, in tokens."""
        return self._slots.available_size()

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        """int64 ``[need_size]`` host slots (whole pages), or ``None`` when too few are free."""
        return self._slots.alloc(need_size)

    def free(self, indices: torch.Tensor) -> None:
        """Give host slots back (whole pages)."""
        self._slots.free(indices)

    def free_slots(self) -> torch.Tensor:
        """Every free host slot, sorted (leak checks; O(size))."""
        return self._slots.free_slots()

    def clear(self) -> None:
        """Every host slot free (server flush, after the tree was reset)."""
        self._slots.clear()

    def backup(self, device_indices: torch.Tensor, host_indices: torch.Tensor) -> None:
        """Copy the KV of ``device_indices`` (int64 ``[n]``) into ``host_indices`` (``[n]``),
        every layer; returns when the copies are done.

        Raises:
            ValueError: the two index tensors differ in length."""
        for dev, host, d_idx, h_idx in self._buffer_pairs(device_indices, host_indices, "backup"):
            host[h_idx] = dev[d_idx].to("cpu")

    def load(self, host_indices: torch.Tensor, device_indices: torch.Tensor) -> None:
        """Copy ``host_indices`` back into the device slots ``device_indices``, every layer;
        returns when the copies are done (a load precedes the forward that reads them).

        Raises:
            ValueError: the two index tensors differ in length."""
        for dev, host, d_idx, h_idx in self._buffer_pairs(device_indices, host_indices, "load"):
            dev[d_idx] = host[h_idx].to(dev.device, non_blocking=False)
        if self.device_buffers and self.device_buffers[0].device.type == "cuda":
            # the scatters are queued on this stream; a forward on another stream reads them
            torch.cuda.current_stream(self.device_buffers[0].device).synchronize()

    def _buffer_pairs(self, device_indices: torch.Tensor, host_indices: torch.Tensor, what: str):
        """``(device buffer, host buffer, device index, host index)`` per buffer, the indices
        int64 on each buffer's device.

        Raises:
            ValueError: the two index tensors differ in length."""
        if device_indices.numel() != host_indices.numel():
            raise ValueError(
                f"HostKVPool.{what}: {device_indices.numel()} device slots for {host_indices.numel()} host slots"
            )
        h_idx = host_indices.to("cpu", torch.int64)
        for dev, host in zip(self.device_buffers, self.host_buffers):
            yield dev, host, device_indices.to(dev.device, torch.int64), h_idx
