"""What each tier could start a prompt from, before anything is read: offers the planner
weighs by what fetching each costs (statecache.costs), and ``take``, which reads the one
it picks.

A local offer names the deepest state in memory and a deeper one on disk; each store
behind them is asked (its index: one round trip for the shared tier) for deeper ones
still. Taking a local offer is a lookup; taking a store's fetches its state (without
the pages the local tiers hold), checks it as any read is checked, and puts it in RAM
as an entry of this pool, which never sends it back.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

from statecache.buffers import Buffer
from statecache.formats.diskfmt import BadFile
from statecache.kvpages import PageKey, page_bytes, rest_logits
from statecache.pages import PageChain, Tokens, as_tokens
from statecache.pool.entries import Entries, Entry
from statecache.pool.lease import Lease
from statecache.pool.reads import Reads
from statecache.pool.writer import DiskWriter
from statecache.records import EntryStats, Kind, Owner
from statecache.tiers.tier import Hit


@dataclass(slots=True, frozen=True)
class Offer:
    """A FULL state the pool could start a prompt from, not read yet."""

    tier: str  # the name of the tier that holds it
    n: int
    nbytes: int
    hit: Hit | None = None  # a store's own handle of it (None: a local state)
    read: bool = True  # taking it reads it from a device or a store (not a copy in RAM)


class Offers:
    def __init__(self, e: Entries, reads: Reads, writer: DiskWriter) -> None:
        self.e = e
        self.reads = reads
        self.writer = writer

    def full_offers(self, tokens: Tokens, chain: PageChain, *, max_n: int, tenant: str
                    ) -> list[Offer]:
        """FULL states usable for ``tokens`` with ``n <= max_n``, nothing read: the
        deepest in memory, a deeper one on disk, deeper ones in the shared store (one
        round trip to its index). ``take`` reads the one the planner picks."""
        e = self.e
        e.check_chain(chain, tenant)
        limit = min(max_n, len(chain))
        offers: list[Offer] = []
        with e.lock:
            for rec in e.index.candidates(chain, kind=Kind.FULL, owner=Owner.TARGET,
                                          lane=None, max_n=limit):
                in_memory = e.in_memory(rec.id)
                if not offers or (in_memory and rec.n == offers[-1].n):
                    tier = e.ram if in_memory else e.disk
                    assert tier is not None
                    offers.append(Offer(tier.name, rec.n, rec.nbytes, read=not in_memory))
                if in_memory:
                    break  # anything shallower than a copy in memory costs more
            stores = list(e.stores)
        deepest = max((o.n for o in offers), default=0)
        for store in stores if limit > deepest else ():
            offers += [Offer(store.name, h.n, h.nbytes, h)
                       for h in store.probe(chain, min_n=deepest, max_n=limit)]
        return offers

    def take(self, offer: Offer, tokens: Tokens, chain: PageChain, *, tenant: str
             ) -> Lease | None:
        """Read ``offer`` (checked as any lookup is); None when it is gone or refused.

        A local offer gives the deepest local state at or below its ``n`` (so a copy
        evicted since is replaced by what is there now)."""
        e = self.e
        if offer.hit is None:
            return self.reads.lookup(tokens, chain, kind=Kind.FULL, owner=Owner.TARGET,
                                     lane=None, max_n=offer.n, tenant=tenant)
        store = e.store(offer.tier)
        if store is None:
            return None
        t0 = time.perf_counter()
        got = store.fetch(offer.hit, as_tokens(tokens), tenant or e.cfg.tenant,
                          self.local_pages)
        assembled = None if got is None else self.reads.assemble(got[0], got[1], got[2])
        if got is None or assembled is None:
            with e.lock:
                e.counts.store_misses += 1
            return None
        rec, rest, pages = got
        data, buf = assembled
        logits = rest_logits(rest)
        e.costs.note_read(store.name, rec.nbytes, time.perf_counter() - t0)
        with e.lock:
            e.counts.hit(store.name)
            entry = e.entries.get(rec.id)
            if entry is None:  # joins RAM as this pool's own entry (never sent back)
                entry = Entry(rec, EntryStats(last_used=e.clock(), hits=1))
                if self.reads.put_ram(entry, rec, rest, pages):
                    e.add(entry)
                    self.writer.queue_write(entry)
                    return Lease(self.reads, rec, store.name, data, e.ram.pin(rec.id), buf,
                                 logits=logits)
        return Lease(self.reads, rec, store.name, data, None, buf, logits=logits)

    def local_pages(self, keys: tuple[PageKey, ...]) -> dict[int, Buffer]:
        """The pages of ``keys`` the local tiers hold (RAM, else read from disk), by index:
        a store fetches only the others."""
        e = self.e
        with e.lock:
            held = self.reads.ram_pages(keys)
            disk = e.disk
            on_disk = [] if disk is None else [
                i for i, k in enumerate(keys) if i not in held and disk.has_page(k)]
        out: dict[int, Buffer] = {i: page_bytes(p) for i, p in held.items()}
        for i in on_disk:
            assert disk is not None
            # gone or bad: the store's copy is fetched instead
            with contextlib.suppress(BadFile, OSError):
                out[i] = disk.read_page(keys[i])
        return out
