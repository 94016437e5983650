"""What the RAM tier holds: one slot per entry (``Pin``: its rest, or a whole state) and
the KV pages its entries share (``SharedPages``: each page once, with counts of the
entries that refer to it).

A page counts its entries three ways: all (live or doomed), live, pinned. The byte
counts that follow from them (used, pinned, leaving) are the RAM tier's: each change of
a page's counts returns what it changes there, so the tier keeps them in step in one
place (``RamTier``'s ``_hold``, ``_let_go``, ``_pin``, ``_unpin``, ``_doom``).
"""

from __future__ import annotations

import mmap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from statecache.kvpages import PageData, PageKey, page_bytes, page_nbytes
from statecache.tiers.policy import EvictionClass

State = bytes | mmap.mmap  # a whole state: never written while RAM holds it


@dataclass(slots=True, eq=False)
class Pin:
    """One entry's bytes; a lease holds it so a removed entry stays valid until released."""

    entry_id: str
    data: bytes | bytearray  # the rest (or a whole state that has no pages)
    cost: int  # the entry's own bytes: rest + token bytes (+ extra)
    cls: EvictionClass
    keys: tuple[PageKey, ...] = ()  # the pages it refers to
    pins: int = 0
    doomed: bool = False  # removed while pinned: freed on the last unpin
    whole: State | None = None  # a host's whole state, its pages views into it
    extra: int = 0  # of cost, the whole state's bytes that are not its pages'


@dataclass(slots=True, frozen=True)
class Whole:
    """A state kept whole beside its rest: ``parts[i]`` (views into ``state``) is the
    page ``keys[i]`` of the entry."""

    state: State
    parts: Sequence[tuple[memoryview, ...]]


@dataclass(slots=True, eq=False)
class _Page:
    data: PageData
    size: int
    refs: int = 0  # entries (live or doomed) that refer to it
    live: int = 0  # of those, not doomed
    pinned: int = 0  # of those, pinned (every doomed one is)
    host: Pin | None = None  # the entry whose whole state ``data`` is a view into

    def copy_out(self) -> None:
        """A page that was a view into its host's state, copied out of it."""
        self.data, self.host = bytes(page_bytes(self.data)), None


class SharedPages:
    def __init__(self) -> None:
        self._pages: dict[PageKey, _Page] = {}
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._pages)

    def __contains__(self, key: object) -> bool:
        return key in self._pages

    def data(self, key: PageKey) -> PageData:
        """A page's bytes, as one buffer or as its parts (immutable: valid after the
        page is freed)."""
        return self._pages[key].data

    def missing(self, keys: Sequence[PageKey]) -> list[int]:
        """Indices of ``keys`` whose pages are not held."""
        return [i for i, k in enumerate(keys) if k not in self._pages]

    def hosts_of(self, keys: Iterable[PageKey]) -> set[Pin]:
        out: set[Pin] = set()
        for key in keys:
            page = self._pages.get(key)
            if page is not None and page.host is not None:
                out.add(page.host)
        return out

    def hosted_by(self, keys: Iterable[PageKey], host: Pin) -> bool:
        """Whether every page of ``keys`` is held, a view into ``host``'s state."""
        return all((page := self._pages.get(k)) is not None and page.host is host
                   for k in keys)

    def would_host(self, keys: Sequence[PageKey], olds: set[Pin]) -> bool:
        """Whether a new entry naming ``keys``, whose pages ``olds`` host now, would keep
        its whole state (room aside): it names pages, no host of them is pinned (a lease
        reads its state), and it is not an older state of one host (all its pages that
        host's, fewer than it has: the state a newer one holds, as a conversation's
        earlier points are)."""
        if not keys:
            return False
        if any(h.pins or h.doomed for h in olds):
            return False
        if len(olds) == 1:
            (old,) = olds
            if len(old.keys) > len(keys) and self.hosted_by(keys, old):
                return False
        return True

    def cost(self, keys: Sequence[PageKey], sizes: Sequence[int]) -> tuple[int, int, int]:
        """What a new entry naming ``keys`` (of ``sizes``) would add: bytes of pages not
        held, bytes it would pin that are not pinned now, bytes of held pages that
        would stop leaving (only doomed entries name them now)."""
        new = pins = back = 0
        for key, size in zip(keys, sizes, strict=True):
            page = self._pages.get(key)
            if page is None:
                new += size
                pins += size
            else:
                pins += 0 if page.pinned else page.size
                back += 0 if page.live else page.size
        return new, pins, back

    def add(self, key: PageKey, blob: PageData, size: int) -> None:
        if page_nbytes(blob) != size:
            raise RuntimeError(f"ram: page {key.hex()} has {page_nbytes(blob)} bytes, not {size}")
        self._pages[key] = _Page(blob, size)
        self.bytes += size

    def view(self, key: PageKey, part: tuple[memoryview, ...], host: Pin) -> None:
        """The page's bytes are now ``part``, a view into ``host``'s whole state (the same
        bytes: its key names them)."""
        page = self._pages[key]
        page.data, page.host = part, host

    def copy_out_of(self, slot: Pin) -> None:
        """Pages that are views into ``slot``'s state, copied out of it."""
        for key in slot.keys:
            page = self._pages[key]
            if page.host is slot:
                page.copy_out()

    # -- counts: each returns the bytes it changes in the tier's own counts -------------

    def hold(self, keys: Iterable[PageKey]) -> int:
        """A new live entry refers to ``keys``; the bytes that no longer leave."""
        back = 0
        for key in keys:
            page = self._pages[key]
            if page.live == 0 and page.refs:
                back += page.size  # only doomed entries held it: it stays now
            page.refs += 1
            page.live += 1
        return back

    def let_go(self, slot: Pin, *, was_live: bool) -> tuple[int, int]:
        """``slot``'s references go (it was removed unpinned, or its last pin went):
        (bytes freed, change of the bytes leaving)."""
        freed = leaving = 0
        for key in slot.keys:
            page = self._pages[key]
            page.refs -= 1
            if was_live:
                page.live -= 1
            if page.refs == 0:
                del self._pages[key]
                self.bytes -= page.size
                freed += page.size
                if not was_live:
                    leaving -= page.size
            else:
                if page.host is slot:  # others name it: out of the state that goes
                    page.copy_out()
                if was_live and page.live == 0:
                    leaving += page.size  # only doomed entries hold it now
        return freed, leaving

    def pin(self, keys: Iterable[PageKey]) -> int:
        """An entry naming ``keys`` is pinned: the bytes pinned now that were not."""
        pinned = 0
        for key in keys:
            page = self._pages[key]
            if page.pinned == 0:
                pinned += page.size
            page.pinned += 1
        return pinned

    def unpin(self, keys: Iterable[PageKey]) -> int:
        """An entry naming ``keys`` is not pinned any more: the bytes no longer pinned."""
        freed = 0
        for key in keys:
            page = self._pages[key]
            page.pinned -= 1
            if page.pinned == 0:
                freed += page.size
        return freed

    def doom(self, keys: Iterable[PageKey]) -> int:
        """An entry naming ``keys`` was removed while pinned: the bytes now leaving."""
        leaving = 0
        for key in keys:
            page = self._pages[key]
            page.live -= 1
            if page.live == 0:
                leaving += page.size
        return leaving

    # -- checks ------------------------------------------------------------------------

    def check(self, every: Sequence[Pin], held: set[Pin]) -> tuple[int, int, int]:
        """Raise RuntimeError unless the counts of each page are those of the entries
        (``every``: live and doomed) that name it, each host is one of ``held``, and
        every state kept whole hosts its pages; (page bytes, pinned, leaving)."""
        refs: dict[PageKey, list[int]] = {}  # key -> [refs, live, pinned]
        for s in every:
            for key in s.keys:
                r = refs.setdefault(key, [0, 0, 0])
                r[0] += 1
                r[1] += 0 if s.doomed else 1
                r[2] += 1 if s.pins else 0
        if set(refs) != set(self._pages):
            raise RuntimeError("ram: pages held differ from the pages entries refer to")
        for key, page in self._pages.items():
            if [page.refs, page.live, page.pinned] != refs[key]:
                raise RuntimeError(f"ram: page {key.hex()} counts {page.refs}/{page.live}/"
                                   f"{page.pinned}, entries say {refs[key]}")
            if page_nbytes(page.data) != page.size:
                raise RuntimeError(f"ram: page {key.hex()} holds other than its size")
            host = page.host
            if host is not None and (host.whole is None or key not in host.keys
                                     or host not in held):
                raise RuntimeError(f"ram: page {key.hex()} is a view of no host's state")
        for s in every:
            if s.whole is None:
                continue
            if any(self._pages[k].host is not s for k in s.keys):
                raise RuntimeError(f"ram: {s.entry_id} keeps its state but not its pages")
            if s.extra != len(s.whole) - sum(self._pages[k].size for k in s.keys):
                raise RuntimeError(f"ram: {s.entry_id} counts {s.extra} bytes beyond its "
                                   "pages, its state holds others")
        pages = sum(p.size for p in self._pages.values())
        if pages != self.bytes:
            raise RuntimeError(f"ram: {self.bytes} page bytes accounted, {pages} held")
        return (pages, sum(p.size for p in self._pages.values() if p.pinned),
                sum(p.size for p in self._pages.values() if not p.live))
