"""What a tier is to the pool: a name, its figures, its invariants (``Tier``); and
what a store behind the local tiers does (``Store``).

The pool holds a RAM tier, a disk tier when one opens, and the stores behind them (the
shared tier of ``[cache.remote]``, and any other a caller gives it); its report, its
sanity check, the cost planner and the live page go over them in that order (nearest
first) through these faces, so none of them names a tier. A tier's figures are the
same record for every tier (``TierStats``); what a tier does not hold that way is None.

A store is asked in three ways. ``probe``: which states it holds for a prompt deeper
than the local tiers do, from its index alone (nothing read); ``fetch``: one of them,
checked (tokens, tenant, model, format, MAC) before it is given back, without the
pages the local tiers hold; ``put``: a new FULL state, sent in the background. The
pool weighs a store's offer against prefilling the tokens it saves, by the store's
bandwidth (``prior_bandwidth`` until one is measured), before anything is read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from statecache.buffers import Buffer
from statecache.kvpages import PageKey
from statecache.pages import PageChain
from statecache.records import CheckpointRecord

# The pages of ``keys`` the local tiers hold already, by index: a store does not send them.
LocalPages = Callable[[tuple[PageKey, ...]], dict[int, Buffer]]
# page i of a state (its record's page_keys[i]) as immutable bytes, copied when asked for:
# a store takes only the pages it does not hold already
PageSource = Callable[[int], bytes]


@dataclass(slots=True)
class StoreStats:
    """A store's own traffic (the shared tier's): counted as it works, copied for a
    report."""

    probes: int = 0  # lookups of its index (one round trip each)
    hits: int = 0  # entries fetched and checked
    read_bytes: int = 0
    rejected: int = 0  # entries refused by their checks, by reason in ``refusals``
    writes: int = 0
    written_bytes: int = 0
    write_dupes: int = 0  # another writer stored it first
    write_drops: int = 0  # dropped from a full queue
    write_skipped: int = 0  # larger than the store takes
    errors: int = 0  # the store failed (down, slow, a reply that makes no sense)
    reconnects: int = 0
    pages_written: int = 0
    pages_present: int = 0  # pages a write found in the store already
    pages_fetched: int = 0
    pages_local: int = 0  # pages a fetch took from the local tiers instead
    skipped: int = 0  # index entries passed over unfetched: refused before
    deleted: int = 0  # headers and pages this key signs, proved bad and deleted
    up: bool = True
    queue: int = 0  # writes waiting (and the one going out)
    queue_bytes: int = 0
    refusals: dict[str, int] = field(default_factory=dict)  # reason -> entries refused

    def refused(self, reason: str) -> int:
        """Count one entry refused for ``reason``; how many so far."""
        self.rejected += 1
        n = self.refusals[reason] = self.refusals.get(reason, 0) + 1
        return n

    def copy(self) -> StoreStats:
        return dataclasses.replace(self, refusals=dict(self.refusals))


@dataclass(slots=True, frozen=True)
class TierStats:
    """One tier's figures at one moment (None: not a figure of this tier)."""

    name: str  # "ram", "disk", "remote": its label in metrics, plans and leases
    label: str  # how a person calls it: "RAM", "Disk", "Shared store"
    where: str = ""  # what it is on: a directory, a store's URL without its password
    status: str = "ok"  # or why it does not serve now
    hits: int = 0  # lookups it served (counted by the pool)
    entries: int | None = None
    bytes: int | None = None
    budget: int | None = None
    pages: int | None = None  # KV pages held once for the checkpoints that name them
    page_bytes: int | None = None
    evictions: int | None = None
    bandwidth: float | None = None  # measured read bandwidth (0: not yet; None: not read)
    store: StoreStats | None = None  # a store's own traffic

    def to_json(self) -> dict[str, object]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["store"] = None if self.store is None else dataclasses.asdict(self.store)
        return out


class Tier(Protocol):
    """A place checkpoints are held, as the pool's report sees it."""

    name: str
    label: str
    # bytes a second a state is read from it, until one is measured (statecache.costs);
    # None: reading from it costs nothing (RAM)
    prior_bandwidth: float | None

    def stats(self) -> TierStats:
        """Its own figures (hits and bandwidth are the pool's to fill in)."""
        ...

    def sanity_check(self) -> None:
        """Raise RuntimeError where its bookkeeping disagrees with what it holds."""
        ...


class Hit(Protocol):
    """A store's index entry for a prompt: a state it holds, not read yet."""

    @property
    def n(self) -> int: ...

    @property
    def nbytes(self) -> int: ...


class Store(Tier, Protocol):
    """A tier behind the local ones: the pool offers its states and sends it new ones."""

    @property
    def status(self) -> str:
        """"ok", or why it does not serve now."""
        ...

    def probe(self, chain: PageChain, *, min_n: int, max_n: int) -> Sequence[Hit]:
        """States for ``chain`` with ``min_n < n <= max_n``, deepest first."""
        ...

    def fetch(self, hit: Any, tokens: Any, tenant: str, local: LocalPages | None = None
              ) -> tuple[CheckpointRecord, Buffer, list[Buffer]] | None:
        """The record, rest and pages of ``hit`` (one of this store's), checked against
        ``tokens`` and ``tenant``; None when it is gone or refused."""
        ...

    def put(self, rec: CheckpointRecord, rest: bytes, page: PageSource | None = None
            ) -> None:
        """Keep a FULL state (``rest`` immutable: it is not copied); ``page`` gives its
        pages (None: it has none)."""
        ...

    def close(self) -> None: ...
