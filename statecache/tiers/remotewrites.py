"""What goes out to the shared store: one background thread, a queue bounded in bytes
(when the store is slower than the engine, the oldest waiting write is dropped), and
the writes themselves: a state's KV pages the store lacks first, then its rest in
chunks under a header that the first writer of an id wins (``SET NX``), then its
index field. Hits keep an entry alive (``touch``); entries that failed their checks
leave the index (``forget``); a header or page of ours proved bad is deleted if it still
holds the bytes that failed (``delete``: a script compares their SHA-1 in the store).

While the engine prefills, the queue waits (``hold``, as the disk writer's:
``tiers.background.PrefillHold``), unless it holds more than half its bytes (a write
dropped would cost more than its MAC and compression beside the prefill) or ``flush``
(shutdown, tests) waits for it.

A page is present when this proxy wrote it or verified its bytes once (``verified``,
bounded), not when a key of its name exists: a write renews those (one round trip,
which also tells a page gone since) and sends every other, so a page overwritten
with anything else is healed by the next writer that never verified it.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis

from statecache.formats import codec
from statecache.formats.pagefmt import encode_page
from statecache.formats.remotefmt import (
    IndexValue,
    chunk_key,
    chunk_views,
    encode_header,
    header_key,
    index_key,
    n_chunks,
    new_nonce,
    page_name,
    space,
    tail_hash,
)
from statecache.kvpages import PageKey
from statecache.records import CheckpointRecord
from statecache.tiers.background import PrefillHold, run_in_background
from statecache.tiers.remotelink import Link
from statecache.tiers.tier import PageSource

log = logging.getLogger(__name__)

PIPELINE_BYTES = 64 << 20  # bytes sent or asked for in one pipeline: bounds its memory
VERIFIED = 1 << 17  # pages remembered as verified (a 64-bit int each), oldest out first
# delete KEYS[1] if its first ARGV[2] + 1 bytes have the SHA-1 ARGV[1]: what failed a check
_DELETE_IF = ("if redis.sha1hex(redis.call('GETRANGE', KEYS[1], 0, ARGV[2])) == ARGV[1] "
              "then return redis.call('DEL', KEYS[1]) end return 0")
# The store failed, not the entry: a cluster that cannot be reached raises the latter.
STORE_ERRORS = (redis.RedisError, redis.exceptions.RedisClusterException, OSError)


@dataclass(slots=True, frozen=True)
class _Write:
    """A write waiting for the store: the record, its rest and every page it names."""

    record: CheckpointRecord
    rest: bytes
    pages: tuple[bytes, ...]


class Outgoing:
    def __init__(self, link: Link, key: bytes, fingerprint: str, *, state_format: int,
                 level: int, page_size: int) -> None:
        self.link = link
        self.space = space(link.cfg.prefix, key)
        self.page_size = page_size
        self._verified: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._key = key
        self.fingerprint = fingerprint
        self.state_format = state_format
        self.page_packer = codec.Packer(level, 2)  # as the disk tier's
        self.rest_packer = codec.Packer(level, 4)
        self._jobs: collections.deque[tuple[str, Any]] = collections.deque()
        self._queued_bytes = 0
        # each page queued writes hold: how many of them name it, and its bytes (one
        # object, which a later write that names it shares rather than copies again)
        self._queued_pages: dict[PageKey, tuple[int, bytes]] = {}
        self._stopping = False
        self._busy = False  # the thread holds a job it took from the queue
        self._hold = PrefillHold(link.lock)
        self._flushing = 0  # flush calls waiting: the queue goes out whatever the hold says
        self._thread = threading.Thread(target=self._loop, name="statecache-remote-writer",
                                        daemon=True)
        self._thread.start()

    def write(self, rec: CheckpointRecord, rest: bytes, page: PageSource | None) -> None:
        """Queue ``rec``: its pages that a queued write holds are that write's bytes; the
        others ``page`` copies (outside the lock)."""
        keys = rec.page_keys
        pages: list[bytes] = []
        if keys:
            if page is None:
                raise ValueError("a state with pages needs their bytes")
            with self.link.lock:
                held = [self._queued_pages.get(k) for k in keys]
            pages = [h[1] if h is not None else page(i) for i, h in enumerate(held)]
        self.enqueue(("write", _Write(rec, rest, tuple(pages))))

    def verified(self, key: PageKey) -> None:
        """``key``'s bytes in the store passed this proxy's check (or it wrote them)."""
        k = int.from_bytes(key[:8], "little")
        with self.link.lock:
            self._verified[k] = None
            self._verified.move_to_end(k)
            if len(self._verified) > VERIFIED:
                self._verified.popitem(last=False)

    def unverified(self, key: PageKey) -> None:
        with self.link.lock:
            self._verified.pop(int.from_bytes(key[:8], "little"), None)

    def _is_verified(self, key: PageKey) -> bool:
        with self.link.lock:
            return int.from_bytes(key[:8], "little") in self._verified

    def queued(self) -> tuple[int, int]:
        """Jobs waiting (and the one going out), and the bytes their writes hold."""
        with self.link.lock:
            return len(self._jobs) + int(self._busy), self._queued_bytes

    def enqueue(self, job: tuple[str, Any]) -> None:
        with self.link.lock:
            if self._stopping:
                return
            self._jobs.append(job)
            if job[0] == "write":
                self._count(job[1], +1)
            while self._queued_bytes > self.link.cfg.queue_bytes:
                kind, payload = self._jobs.popleft()
                if kind == "write":
                    self._count(payload, -1)
                    self.link.counts.write_drops += 1
            self.link.lock.notify_all()

    def _count(self, w: _Write, sign: int) -> None:
        """Writes waiting hold their rest, and each page once however many name it."""
        self._queued_bytes += sign * len(w.rest)
        for k, page in zip(w.record.page_keys, w.pages, strict=True):
            held, kept = self._queued_pages.get(k, (0, page))
            if (sign > 0 and held == 0) or (sign < 0 and held == 1):
                self._queued_bytes += sign * len(page)
            if held + sign:
                self._queued_pages[k] = (held + sign, kept)
            else:
                del self._queued_pages[k]

    def hold(self, on: bool) -> None:
        """The engine prefills (``on``) or no longer does: the queue waits meanwhile."""
        self._hold.set(on)

    def _held_for(self) -> float:
        """How much longer the queue waits for the engine (lock held): 0 to go now."""
        if self._stopping or self._flushing or \
                self._queued_bytes > self.link.cfg.queue_bytes // 2:
            return 0.0
        return self._hold.left()

    def _next(self) -> tuple[str, Any] | None:
        with self.link.lock:
            while True:
                link, now = self.link, time.monotonic()
                down = 0.0 if link.up else max(link.retry_at - now, 0.0)
                held = self._held_for() if self._jobs else 0.0
                if self._jobs and not down and not held:
                    job = self._jobs.popleft()
                    if job[0] == "write":
                        self._count(job[1], -1)
                    self._busy = True
                    return job
                if self._stopping:
                    return None
                # nothing queued: until a job comes; else until the store may be tried
                # again and the hold is over, whichever is later (each wakes the loop)
                wait = max(down, held) if self._jobs else None
                self.link.lock.wait(max(wait, 0.01) if wait is not None else None)

    def _loop(self) -> None:
        run_in_background()
        while True:
            job = self._next()
            if job is None:
                return
            kind, payload = job
            try:
                if kind == "write":
                    self._write(payload)
                elif kind == "touch":
                    self._touch(*payload)
                elif kind == "delete":
                    name, digest, size = payload
                    if self.link.client.eval(_DELETE_IF, 1, name, digest, size - 1):
                        self.link.counts.deleted += 1
                        log.info("remote tier: deleted %s, which failed its check", name)
                else:
                    self.link.client.hdel(payload.index_key, payload.entry_id)
                self.link.ok()
            except STORE_ERRORS as e:
                self.link.failed(e)
                if kind == "write":  # tried again when the store is back, if still room
                    self.enqueue(job)
            except Exception:
                log.exception("remote tier: a %s failed", kind)
            finally:
                with self.link.lock:
                    self._busy = False
                    self.link.lock.notify_all()

    def _ttl(self) -> int | None:
        return int(self.link.cfg.ttl * 1000) if self.link.cfg.ttl > 0 else None

    def _write(self, w: _Write) -> None:
        rec = w.record
        hkey = header_key(self.space, rec.id)
        ttl = self._ttl()
        # its pages first, even where the entry is stored already: a page of it that
        # failed a check since is written again by the first proxy that holds it
        self._write_pages(rec, w.pages, ttl)
        if self.link.client.exists(hkey):  # another proxy (or this one) stored it already
            self.link.counts.write_dupes += 1
            return
        kind, stored = self.rest_packer.encode(w.rest)
        view = memoryview(stored).cast("B")
        nonce, size = new_nonce(), self.link.cfg.chunk_size
        pipe = self.link.client.pipeline(transaction=False)
        chunks = [chunk_key(self.space, rec.id, nonce, i)
                  for i in range(n_chunks(view.nbytes, size))]
        for k, part in zip(chunks, chunk_views(view, size), strict=True):
            pipe.set(k, bytes(part), px=ttl)
        pipe.set(hkey, encode_header(rec, view, self._key, nonce, size, kind), px=ttl, nx=True)
        won = pipe.execute()[-1]
        if not won:  # lost the race to another writer: its entry stands
            self.link.client.delete(*chunks)
            self.link.counts.write_dupes += 1
            return
        if not rec.page_hashes:
            return
        ikey = index_key(self.space, self.state_format, rec.page_hashes[-1])
        value = IndexValue(rec.n, rec.nbytes, view.nbytes, nonce, size, len(chunks),
                           tail_hash(rec.tokens, rec.n, self.page_size)).pack()
        pipe = self.link.client.pipeline(transaction=False)
        pipe.hset(ikey, rec.id, value)
        if ttl is not None:
            pipe.pexpire(ikey, ttl)
        pipe.execute()
        self.link.counts.writes += 1
        self.link.counts.written_bytes += view.nbytes

    def _write_pages(self, rec: CheckpointRecord, pages: Sequence[bytes], ttl: int | None
                     ) -> None:
        """Every page of ``rec`` in the store before its header: those this proxy
        verified there live another ``ttl`` (one round trip, which tells those gone
        since), the others are sent."""
        keys = rec.page_keys
        if not keys:
            return
        names = [page_name(self.space, self.fingerprint, k) for k in keys]
        known = [i for i, k in enumerate(keys) if self._is_verified(k)]
        pipe = self.link.client.pipeline(transaction=False)
        for i in known:
            if ttl is None:
                pipe.exists(names[i])
            else:
                pipe.pexpire(names[i], ttl)
        there = dict(zip(known, pipe.execute(), strict=True)) if known else {}
        missing = [i for i in range(len(keys)) if not there.get(i)]
        self.link.counts.pages_present += len(keys) - len(missing)
        sent = total = 0
        pipe = self.link.client.pipeline(transaction=False)
        for i in missing:
            blob = b"".join(encode_page(self._key, keys[i], pages[i], self.page_packer.encode))
            pipe.set(names[i], blob, px=ttl)
            sent += len(blob)
            total += len(blob)
            if sent >= PIPELINE_BYTES:
                pipe.execute()
                pipe, sent = self.link.client.pipeline(transaction=False), 0
        pipe.execute()
        for i in missing:
            self.verified(keys[i])
        self.link.counts.pages_written += len(missing)
        self.link.counts.written_bytes += total

    def _touch(self, hit: Any, rec: CheckpointRecord) -> None:
        """A hit keeps the entry (its index key and its pages) alive another ``ttl``."""
        ttl = self._ttl()
        if ttl is None:
            return
        pipe = self.link.client.pipeline(transaction=False)
        pipe.pexpire(header_key(self.space, rec.id), ttl)
        for i in range(hit.value.chunks):
            pipe.pexpire(chunk_key(self.space, rec.id, hit.value.nonce, i), ttl)
        for k in rec.page_keys:
            pipe.pexpire(page_name(self.space, self.fingerprint, k), ttl)
        pipe.pexpire(hit.index_key, ttl)
        pipe.execute()

    def pending(self) -> int:
        with self.link.lock:
            return len(self._jobs)

    def flush(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for queued jobs to go out (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        with self.link.lock:
            self._flushing += 1
            self.link.lock.notify_all()
            try:
                while self._jobs or self._busy:
                    left = deadline - time.monotonic()
                    if left <= 0 or not self._thread.is_alive():
                        return False
                    self.link.lock.wait(min(left, 0.05))
                return True
            finally:
                self._flushing -= 1

    def close(self, timeout: float = 2.0) -> None:
        """Let queued writes go out for up to ``timeout`` s (none while the store is
        down: shutdown never waits for it), then stop."""
        if self.link.up:
            self.flush(timeout)
        with self.link.lock:
            self._stopping = True
            self._jobs.clear()
            self._queued_bytes = 0
            self._queued_pages.clear()
            self.link.lock.notify_all()
        self._thread.join(timeout)
        self.link.close()

    def sanity_check(self) -> None:
        """The queue's byte count is what its writes hold, within the bound."""
        with self.link.lock:
            held, seen = 0, set()
            for kind, w in self._jobs:
                if kind != "write":
                    continue
                held += len(w.rest)
                for k, page in zip(w.record.page_keys, w.pages, strict=True):
                    if k not in seen:
                        seen.add(k)
                        held += len(page)
            if held != self._queued_bytes or held > self.link.cfg.queue_bytes:
                raise RuntimeError(f"remote: queue holds {held} bytes, counts "
                                   f"{self._queued_bytes}, bound {self.link.cfg.queue_bytes}")
