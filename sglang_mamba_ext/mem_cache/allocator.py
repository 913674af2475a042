"""Free-list allocator of KV-pool slots, handed out in pages (``docs/design.md``, "Tree and
match").

SGLang's scheduler hands the cache its own ``TokenToKVPoolAllocator`` /
``PagedTokenToKVPoolAllocator`` (``sglang/srt/mem_cache/allocator``); the core only relies on
the duck type implemented here: ``alloc(n)``, ``free(indices)``, ``available_size()``,
``size`` and ``page_size``. This class is the stand-in used by the core's tests, the
benchmarks and the CPU simulations.
"""

from __future__ import annotations

from typing import List, Optional

import torch


class KVSlotAllocator:
    """Free list of KV slots, handed out in pages.

    Slot (and page) 0 is reserved as SGLang does (it is the padding slot that dummy writes
    target), so the usable slots are ``1 .. size`` when ``page_size == 1`` and the pages
    ``1 .. size // page_size`` otherwise.

    Args:
        size: usable KV slots (tokens). Must be a positive multiple of ``page_size``.
        page_size: tokens per page (>= 1).
        device: where the returned index tensors live.

    Raises:
        ValueError: if ``size`` or ``page_size`` is not positive, or ``size`` is not a
            multiple of ``page_size``.
    """

    def __init__(self, size: int, page_size: int = 1, device: str | torch.device = "cpu"):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if size < page_size or size % page_size:
            raise ValueError(
                f"KV pool size must be a positive multiple of page_size={page_size}, got {size}"
            )
        self.size = size
        self.page_size = page_size
        self.device = torch.device(device)
        self.num_pages = size // page_size
        # The free list is a tensor of free page ids plus a list of freed tensors waiting
        # to be merged; merging is deferred until an allocation needs them (one cat, not
        # one per free).
        self._free_pages = torch.arange(1, self.num_pages + 1, dtype=torch.int64, device=self.device)
        self._released: List[torch.Tensor] = []
        self._num_free_pages = self.num_pages
        self._page_offsets = torch.arange(page_size, dtype=torch.int64, device=self.device)

    # -- protocol ---------------------------------------------------------------------
    def available_size(self) -> int:
        """Free slots, in tokens."""
        return self._num_free_pages * self.page_size

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        """Take ``need_size`` slots.

        Args:
            need_size: tokens; must be a multiple of ``page_size``.

        Returns:
            int64 tensor ``[need_size]`` of slot indices (whole pages, in order), or ``None``
            when fewer than ``need_size`` slots are free (nothing is taken then).

        Raises:
            ValueError: if ``need_size`` is negative or not page aligned.
        """
        if need_size < 0 or need_size % self.page_size:
            raise ValueError(
                f"alloc({need_size}): size must be a non-negative multiple of page_size={self.page_size}"
            )
        n_pages = need_size // self.page_size
        if n_pages > self._num_free_pages:
            return None
        if n_pages > self._free_pages.numel():
            self._merge()
        pages = self._free_pages[:n_pages]
        self._free_pages = self._free_pages[n_pages:]
        self._num_free_pages -= n_pages
        if self.page_size == 1:
            # A copy, so callers (and tree nodes holding slices) never pin the free list.
            return pages.clone()
        return (pages[:, None] * self.page_size + self._page_offsets).reshape(-1)

    def free(self, indices: torch.Tensor) -> None:
        """Return slots to the free list.

        Args:
            indices: int tensor of slot indices. With ``page_size > 1`` every page touched
                by ``indices`` is freed whole (the caller frees only pages it owns fully).
        """
        if indices is None or indices.numel() == 0:
            return
        if self.page_size == 1:
            pages = indices.to(torch.int64)
        else:
            pages = torch.unique(indices.to(torch.int64) // self.page_size)
        self._released.append(pages)
        self._num_free_pages += pages.numel()

    # -- helpers ----------------------------------------------------------------------
    def _merge(self) -> None:
        if self._released:
            self._free_pages = torch.cat([self._free_pages, *self._released])
            self._released = []

    def free_slots(self) -> torch.Tensor:
        """All free slot indices (tokens), sorted; for leak checks and tests (O(size))."""
        self._merge()
        pages = torch.sort(self._free_pages).values
        if self.page_size == 1:
            return pages
        return (pages[:, None] * self.page_size + self._page_offsets).reshape(-1)

    def clear(self) -> None:
        """Free every slot (server flush)."""
        self._free_pages = torch.arange(1, self.num_pages + 1, dtype=torch.int64, device=self.device)
        self._released = []
        self._num_free_pages = self.num_pages
