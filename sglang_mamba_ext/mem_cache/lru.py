"""Intrusive doubly linked LRU list with O(1) touch / remove (``docs/design.md``,
"Eviction": ``full_lru_list`` and ``mamba_lru_list`` are two independent instances)."""

from __future__ import annotations

from typing import Any, Iterator, Optional


class LRULink:
    """A node's membership in one LRU list. ``prev`` points toward the most recently used
    end (the head), ``next`` toward the least recently used end (the tail)."""

    __slots__ = ("prev", "next", "owner", "linked")

    def __init__(self, owner: Any = None):
        self.prev: Optional[LRULink] = None
        self.next: Optional[LRULink] = None
        self.owner = owner
        self.linked = False


class LRUList:
    """Most recently used at the head, least recently used at the tail.

    Unlinking leaves a link's pointers in place, so an eviction scan that walks from
    the tail toward the head can step past links removed under it (see :meth:`step_toward_head`).
    """

    __slots__ = ("head", "tail", "size")

    def __init__(self):
        self.head = LRULink()
        self.tail = LRULink()
        self.head.next = self.tail
        self.tail.prev = self.head
        self.head.linked = self.tail.linked = True
        self.size = 0

    def push_front(self, link: LRULink) -> None:
        """Insert (or move) ``link`` at the most recently used end."""
        if link.linked:
            self._unlink(link)
        first = self.head.next
        link.prev = self.head
        link.next = first
        first.prev = link
        self.head.next = link
        link.linked = True
        self.size += 1

    def insert_before(self, link: LRULink, anchor: LRULink) -> None:
        """Insert ``link`` just on the head side of ``anchor`` (slightly more recent)."""
        if link.linked:
            self._unlink(link)
        before = anchor.prev
        link.prev = before
        link.next = anchor
        before.next = link
        anchor.prev = link
        link.linked = True
        self.size += 1

    def remove(self, link: LRULink) -> None:
        if link.linked:
            self._unlink(link)

    def _unlink(self, link: LRULink) -> None:
        link.prev.next = link.next
        link.next.prev = link.prev
        link.linked = False
        self.size -= 1

    def lru(self) -> Optional[LRULink]:
        """The least recently used link, or ``None`` when empty."""
        last = self.tail.prev
        return None if last is self.head else last

    def step_toward_head(self, link: LRULink) -> Optional[LRULink]:
        """The next more recently used link still in the list after ``link`` (which may
        have been unlinked since it was reached), or ``None`` at the head."""
        nxt = link.prev
        while nxt is not None and not nxt.linked:
            nxt = nxt.prev
        if nxt is None or nxt is self.head:
            return None
        return nxt

    def __iter__(self) -> Iterator[LRULink]:
        """Links from most to least recently used."""
        link = self.head.next
        while link is not self.tail:
            yield link
            link = link.next

    def __len__(self) -> int:
        return self.size
