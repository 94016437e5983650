"""Opening the tiers a pool is configured with (``[cache]``'s disk, ``[cache.remote]``)
and the stores it is given, and closing them: every FULL state written to disk first.

A tier that cannot open is off, with one line saying why (``Entries.disk_status``,
``remote_status``), never a crash: the pool serves from the tiers that opened.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from statecache.formats.trust import Untrusted, load_key
from statecache.kvpages import PageKey
from statecache.pool.entries import Entries, Entry
from statecache.pool.index import Index
from statecache.pool.writer import DiskWriter
from statecache.records import CheckpointRecord, EntryStats, RecordHead
from statecache.tiers.dirlock import DirLock
from statecache.tiers.opendisk import open_disk
from statecache.tiers.remote import RemoteTier
from statecache.tiers.tier import Store

log = logging.getLogger(__name__)

_NAMED = 8  # pages gone at start named each in a warning; the others at debug level


def open_tiers(e: Entries, stores: Sequence[Store]) -> DirLock | None:
    """Open the disk tier and the shared tier as the configuration says, put ``stores``
    behind them, and tell the costs each tier's prior bandwidth; the lock of the disk
    tier's directory (None: no disk tier)."""
    lock = _disk(e) if e.cfg.disk_enabled else None
    if e.cfg.remote.url:
        _remote(e)
    e.stores += stores
    for tier in (e.ram, e.disk, *e.stores):
        if tier is not None:
            e.costs.know(tier.name, tier.prior_bandwidth)
    return lock


def _disk(e: Entries) -> DirLock | None:
    opened = open_disk(e.cfg, e.fingerprint, state_format=e.state_format,
                       on_evict=e.disk_evicted)
    if isinstance(opened, str):
        e.disk_status = opened
        log.warning("pool: the disk tier is off: %s", opened)
        return None
    disk, lock = opened
    e.disk = disk

    def found(rec: CheckpointRecord) -> None:
        """A record found at start: indexed by its head (its tokens and pages stay in
        its file)."""
        e.add(Entry(rec.head(), EntryStats(last_used=rec.created)), rec.page_hashes)

    named = [0]  # pages named in a warning of their own; the scan's summary counts all

    def lost(key: PageKey, why: str, heads: list[RecordHead]) -> None:
        named[0] += 1
        e.lost.note(disk.name, key.hex(), why, heads, e.counts.dropped,
                    quiet=named[0] > _NAMED)

    disk.scan(found, lost)
    e.disk_status = "ok"
    log.info("pool: %d checkpoints found on disk in %s", len(disk), disk.path)
    return lock


def _remote(e: Entries) -> None:
    rc = e.cfg.remote
    key_path = Path(rc.secret_path or e.cfg.secret_path).expanduser()
    try:
        key = load_key(key_path)
    except (Untrusted, OSError) as err:
        e.remote_status = f"off: its key {key_path}: {err}"
        log.warning("pool: the remote tier is off: %s", e.remote_status)
        return
    remote = RemoteTier(rc, key, e.fingerprint, state_format=e.state_format,
                        page_size=e.page_size, level=e.cfg.compress_level)
    remote.ping()
    e.remote, e.remote_status = remote, remote.status
    e.stores.append(remote)


def close_tiers(e: Entries, writer: DiskWriter, lock: DirLock | None) -> None:
    """Close the stores, write every FULL state to disk, then release RAM and the disk
    directory (call once, without the pool's lock)."""
    for store in e.stores:
        store.close()
    e.stores.clear()
    if e.remote is not None:
        e.remote = None
        e.remote_status = "closed"
    writer.stop()
    writer.flush()
    with e.cond:
        while e.writing:  # a direct write of an insert racing this close
            e.cond.wait(0.5)
        for entry_id in list(e.ram.ids()):
            e.ram.remove(entry_id)
        for pin in e.spilling.values():  # only states whose write failed
            e.ram.unpin(pin)
        e.spilling.clear()
        e.entries.clear()
        e.by_lane.clear()
        e.index = Index()
        e.queue.clear()
        if lock is not None:
            lock.release()
        if e.disk is not None:
            e.disk_status = "closed"
        e.disk = None
