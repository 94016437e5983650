"""The shared tier: FULL checkpoints in Redis or Valkey, for several proxies at once.

Never in the way of the engine:

- writes go out on one background thread from a queue bounded in bytes; when the
  store is slower than the engine, the oldest waiting write is dropped;
- a lookup is one pipelined round trip (the prompt's page hashes against the index,
  deepest first) and reads nothing else; the state is fetched only when the planner
  picks it, and its header (key, model, state format, tenant, tokens) and MAC are
  checked before it is used; of its KV pages, only those the local tiers lack are
  fetched, and a write sends only the pages the store lacks;
- any failure of the store (down, slow, full, a reply that makes no sense) turns the
  tier off for ``retry_s`` with one warning and a counter; it is tried again by
  itself, and says so when it is back.

Layout and checks: ``statecache.formats.remotefmt``. Uses redis-py, which speaks to Valkey too.
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
from redis.backoff import NoBackoff
from redis.retry import Retry

from statecache.buffers import Buffer
from statecache.config import RemoteConfig
from statecache.formats import codec
from statecache.formats.diskfmt import valid_id
from statecache.formats.pagefmt import BadPage, decode_page, encode_page
from statecache.formats.remotefmt import (
    MAX_HEADER_BYTES,
    BadEntry,
    Header,
    IndexValue,
    chunk_key,
    chunk_views,
    decode_header,
    encode_header,
    header_key,
    index_key,
    join_rest,
    n_chunks,
    new_nonce,
    page_name,
)
from statecache.kvpages import PageKey
from statecache.pages import PageChain
from statecache.records import CheckpointRecord, Kind, Owner
from statecache.tiers.background import run_in_background
from statecache.tiers.tier import LocalPages, StoreStats, TierStats

log = logging.getLogger(__name__)

_FETCH_BATCH = 64 << 20  # bytes asked for in one pipeline: bounds a read's extra memory
_CANDIDATES = 4  # remote hits returned by one probe, deepest first
# The store failed, not the entry: a cluster that cannot be reached raises the latter.
_STORE_ERRORS = (redis.RedisError, redis.exceptions.RedisClusterException, OSError)


@dataclass(slots=True, frozen=True)
class RemoteHit:
    """An index entry deeper than what the local tiers hold (not yet checked)."""

    entry_id: str
    index_key: str
    value: IndexValue

    @property
    def n(self) -> int:
        return self.value.n

    @property
    def nbytes(self) -> int:
        return self.value.nbytes


@dataclass(slots=True, frozen=True)
class _Write:
    """A write waiting for the store: the record, its rest and every page it names."""

    record: CheckpointRecord
    rest: bytes
    pages: tuple[bytes, ...]


def connect(url: str, *, cluster: bool = False, timeout: float = 2.0) -> Any:
    """A redis-py client for ``url`` (valkey:// spelled as redis://); no command sent."""
    for scheme, same in (("valkey://", "redis://"), ("valkeys://", "rediss://")):
        if url.startswith(scheme):
            url = same + url[len(scheme):]
    kw: dict[str, Any] = dict(socket_timeout=timeout,
                              socket_connect_timeout=max(0.1, timeout / 10))
    if cluster:
        from redis.cluster import RedisCluster
        return RedisCluster.from_url(url, **kw)
    return redis.Redis.from_url(url, retry=Retry(NoBackoff(), 0), **kw)


def where(url: str) -> str:
    """``url`` without its password, for logs."""
    scheme, sep, rest = url.partition("://")
    return f"{scheme}{sep}{rest.rpartition('@')[2]}"


class RemoteTier:
    name = "remote"
    label = "Shared store"
    prior_bandwidth: float | None = 2e8  # bytes/s, read and checked, until measured

    def __init__(self, cfg: RemoteConfig, key: bytes, fingerprint: str, *, state_format: int,
                 page_size: int, client: Any = None, level: int = codec.DEFAULT_LEVEL) -> None:
        self.cfg = cfg
        self.page_packer = codec.Packer(level, 2)  # as the disk tier's
        self.rest_packer = codec.Packer(level, 4)
        self.prefix = cfg.prefix
        self._key = key
        self.fingerprint = fingerprint
        self.state_format = state_format
        self.page_size = page_size
        self.where = where(cfg.url)
        self._client = client
        self._lock = threading.Condition()
        self._up = True
        self._retry_at = 0.0
        self.counts = StoreStats()
        self._jobs: collections.deque[tuple[str, Any]] = collections.deque()
        self._queued_bytes = 0
        self._queued_pages: collections.Counter[PageKey] = collections.Counter()
        self._stopping = False
        self._busy = False  # the writer holds a job it took from the queue
        self._thread = threading.Thread(target=self._loop, name="statecache-remote-writer",
                                        daemon=True)
        self._thread.start()

    # -- health ------------------------------------------------------------------------

    @property
    def client(self) -> Any:
        if self._client is None:  # a cluster client talks to the cluster as it is made
            self._client = connect(self.cfg.url, cluster=self.cfg.cluster,
                                   timeout=self.cfg.timeout)
        return self._client

    def usable(self) -> bool:
        with self._lock:
            return self._up or time.monotonic() >= self._retry_at

    @property
    def status(self) -> str:
        return f"ok ({self.where})" if self._up else f"unreachable ({self.where}), retrying"

    def ping(self) -> bool:
        try:
            self.client.ping()
        except Exception as e:
            self._failed(e)
            return False
        self._ok()
        return True

    def _failed(self, e: BaseException) -> None:
        with self._lock:
            self.counts.errors += 1
            self._retry_at = time.monotonic() + self.cfg.retry_s
            was_up, self._up = self._up, False
        if was_up:
            log.warning("remote tier %s: %s: %s; serving from RAM and disk, retrying every "
                        "%g s", self.where, type(e).__name__, e, self.cfg.retry_s)
        else:
            log.debug("remote tier %s still failing: %s", self.where, e)

    def _ok(self) -> None:
        with self._lock:
            was_up, self._up = self._up, True
        if not was_up:
            self.counts.reconnects += 1
            log.warning("remote tier %s: reachable again", self.where)

    # -- lookups (engine thread) -------------------------------------------------------

    def probe(self, chain: PageChain, *, min_n: int, max_n: int) -> list[RemoteHit]:
        """Index entries with ``min_n < n <= max_n`` for this chain, deepest first; one
        round trip. Nothing is checked yet but the index value's own sanity."""
        if not self.usable():
            return []
        page = chain.page_size
        lo, hi = max(1, min_n // page), min(len(chain.hashes), max_n // page)
        if hi < lo:
            return []
        keys = [index_key(self.prefix, self.state_format, chain.hashes[k - 1])
                for k in range(hi, lo - 1, -1)]
        try:
            pipe = self.client.pipeline(transaction=False)
            for k in keys:
                pipe.hgetall(k)
            replies = pipe.execute(raise_on_error=False)
        except Exception as e:
            self._failed(e)
            return []
        self._ok()
        self.counts.probes += 1
        hits: list[RemoteHit] = []
        for key, reply in zip(keys, replies, strict=True):
            if not isinstance(reply, dict):  # a WRONGTYPE error, say: some other key
                self._reject("index", f"index reply is not a hash: {reply!r:.80}")
                continue
            for field, raw in reply.items():
                hit = self._parse_hit(key, field, raw, page, min_n, max_n)
                if hit is not None:
                    hits.append(hit)
        hits.sort(key=lambda h: h.n, reverse=True)
        return hits[:_CANDIDATES]

    def _parse_hit(self, key: str, field: object, raw: object, page: int, min_n: int,
                   max_n: int) -> RemoteHit | None:
        try:
            entry_id = field.decode() if isinstance(field, bytes) else ""
            if not valid_id(entry_id):
                raise BadEntry("index", "not an entry id")
            value = IndexValue.unpack(raw, self.cfg.max_entry)
        except (BadEntry, UnicodeDecodeError) as e:
            self._reject(getattr(e, "reason", "index"), str(e))
            return None
        if not min_n < value.n <= max_n:
            return None  # a longer or shorter entry ending in this page
        return RemoteHit(entry_id, key, value)

    def fetch(self, hit: RemoteHit, tokens: Any, tenant: str,
              local: LocalPages | None = None
              ) -> tuple[CheckpointRecord, Buffer, list[Buffer]] | None:
        """The verified rest and pages of ``hit``, or None (a miss, counted by its reason).
        Pages ``local`` gives are not fetched."""
        if not self.usable():
            return None
        v = hit.value
        keys = [chunk_key(self.prefix, hit.entry_id, v.nonce, i) for i in range(v.chunks)]
        per = max(1, _FETCH_BATCH // v.chunk_size)
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.getrange(header_key(self.prefix, hit.entry_id), 0, MAX_HEADER_BYTES)
            for k in keys[:per]:
                pipe.getrange(k, 0, v.chunk_size)  # one byte more than a chunk: never larger
            replies = pipe.execute(raise_on_error=False)
        except Exception as e:
            self._failed(e)
            return None
        try:
            header = decode_header(replies[0], self._key, self.page_size)
            rec = header.record
            self._check(hit, header, rec, tokens, tenant)
            parts = list(replies[1:])
            for i in range(per, len(keys), per):
                pipe = self.client.pipeline(transaction=False)
                for k in keys[i:i + per]:
                    pipe.getrange(k, 0, v.chunk_size)
                parts += pipe.execute(raise_on_error=False)
            rest = join_rest(header, parts, self._key)
            pages = self._fetch_pages(rec, local)
        except BadEntry as e:
            self._reject(e.reason, str(e), hit)
            return None
        except _STORE_ERRORS as e:
            self._failed(e)
            return None
        except Exception as e:  # a reply of an unexpected shape: never a crash
            self._reject("corrupt", f"{type(e).__name__}: {e}", hit)
            return None
        self._ok()
        self.counts.hits += 1
        self.counts.read_bytes += header.stored
        self._enqueue(("touch", (hit, rec)), 0)
        return rec, rest, pages

    def _fetch_pages(self, rec: CheckpointRecord, local: LocalPages | None) -> list[Buffer]:
        """``rec``'s pages: the local ones as given, the others from the store (in
        batches of at most _FETCH_BATCH bytes), each checked; raises BadEntry."""
        keys = rec.page_keys
        have = local(keys) if local is not None and keys else {}
        want = [i for i in range(len(keys)) if i not in have]
        self.counts.pages_local += len(have)
        out: dict[int, Buffer] = dict(have)
        batch = max(1, _FETCH_BATCH // max(1, rec.nbytes // max(1, len(keys))))
        for at in range(0, len(want), batch):
            pipe = self.client.pipeline(transaction=False)
            for i in want[at:at + batch]:
                pipe.get(page_name(self.prefix, self.fingerprint, keys[i]))
            for i, blob in zip(want[at:at + batch], pipe.execute(raise_on_error=False),
                               strict=True):
                if not isinstance(blob, bytes):
                    raise BadEntry("missing", f"page {keys[i].hex()} is not in the store")
                try:
                    out[i] = decode_page(self._key, keys[i], blob)
                except BadPage as e:
                    raise BadEntry(e.reason, f"page {keys[i].hex()}: {e}") from None
                self.counts.read_bytes += len(blob)
        self.counts.pages_fetched += len(want)
        return [out[i] for i in range(len(keys))]

    def _check(self, hit: RemoteHit, header: Header, rec: CheckpointRecord, tokens: Any,
               tenant: str) -> None:
        if rec.id != hit.entry_id:
            raise BadEntry("corrupt", "header of another entry")
        if header.stored != hit.value.stored or header.chunks != hit.value.chunks:
            raise BadEntry("stale", "the index names another write of this entry")
        if header.nonce != hit.value.nonce:
            raise BadEntry("stale", "the index names another write of this entry")
        if rec.fingerprint != self.fingerprint:
            raise BadEntry("foreign_model", "written for another model")
        if rec.state_format != self.state_format:
            raise BadEntry("state_format", f"state format {rec.state_format}")
        if rec.tenant != tenant:
            raise BadEntry("tenant", "another tenant's entry")
        if rec.kind is not Kind.FULL or rec.owner is not Owner.TARGET:
            raise BadEntry("corrupt", "not a full target state")
        if rec.n != hit.n or rec.nbytes != hit.nbytes or not rec.matches(tokens):
            raise BadEntry("tokens", "its tokens are not this prompt's")

    def _reject(self, reason: str, detail: str, hit: RemoteHit | None = None) -> None:
        level = logging.DEBUG if self.counts.refused(reason) > 1 else logging.WARNING
        log.log(level, "remote tier: an entry was refused (%s): %s", reason, detail)
        if hit is not None and reason in ("missing", "stale", "corrupt", "forged"):
            self._enqueue(("forget", hit), 0)  # its index field points at nothing usable

    # -- writes (background) -----------------------------------------------------------

    def put(self, rec: CheckpointRecord, rest: bytes, pages: Sequence[bytes] = ()) -> None:
        """Queue ``rest`` and ``pages`` (not copied: pass immutable bytes) for the store."""
        if rec.kind is not Kind.FULL or rec.owner is not Owner.TARGET:
            return
        if rec.nbytes > self.cfg.max_entry or rec.nbytes > self.cfg.queue_bytes:
            self.counts.write_skipped += 1
            return
        self._enqueue(("write", _Write(rec, rest, tuple(pages))), 0)

    def _enqueue(self, job: tuple[str, Any], nbytes: int) -> None:
        with self._lock:
            if self._stopping:
                return
            self._jobs.append(job)
            if job[0] == "write":
                self._count(job[1], +1)
            while self._queued_bytes > self.cfg.queue_bytes:
                kind, payload = self._jobs.popleft()
                if kind == "write":
                    self._count(payload, -1)
                    self.counts.write_drops += 1
            self._lock.notify_all()

    def _count(self, w: _Write, sign: int) -> None:
        """Writes waiting hold their rest, and each page once however many name it."""
        self._queued_bytes += sign * len(w.rest)
        for k, page in zip(w.record.page_keys, w.pages, strict=True):
            held = self._queued_pages[k]
            if (sign > 0 and held == 0) or (sign < 0 and held == 1):
                self._queued_bytes += sign * len(page)
            self._queued_pages[k] = held + sign
            if self._queued_pages[k] == 0:
                del self._queued_pages[k]

    def _next(self) -> tuple[str, Any] | None:
        with self._lock:
            while True:
                if self._jobs and (self._up or time.monotonic() >= self._retry_at):
                    job = self._jobs.popleft()
                    if job[0] == "write":
                        self._count(job[1], -1)
                    self._busy = True
                    return job
                if self._stopping:
                    return None
                wait = None if self._up or not self._jobs else self._retry_at - time.monotonic()
                self._lock.wait(max(wait, 0.01) if wait is not None else None)

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
                else:
                    self.client.hdel(payload.index_key, payload.entry_id)
                self._ok()
            except _STORE_ERRORS as e:
                self._failed(e)
                if kind == "write":  # tried again when the store is back, if still room
                    self._enqueue(job, 0)
            except Exception:
                log.exception("remote tier: a %s failed", kind)
            finally:
                with self._lock:
                    self._busy = False
                    self._lock.notify_all()

    def _ttl(self) -> int | None:
        return int(self.cfg.ttl * 1000) if self.cfg.ttl > 0 else None

    def _write(self, w: _Write) -> None:
        rec = w.record
        hkey = header_key(self.prefix, rec.id)
        if self.client.exists(hkey):  # another proxy (or this one) stored it already
            self.counts.write_dupes += 1
            return
        ttl = self._ttl()
        self._write_pages(rec, w.pages, ttl)
        kind, stored = self.rest_packer.encode(w.rest)
        view = memoryview(stored).cast("B")
        nonce, size = new_nonce(), self.cfg.chunk_size
        pipe = self.client.pipeline(transaction=False)
        chunks = [chunk_key(self.prefix, rec.id, nonce, i)
                  for i in range(n_chunks(view.nbytes, size))]
        for k, part in zip(chunks, chunk_views(view, size), strict=True):
            pipe.set(k, bytes(part), px=ttl)
        pipe.set(hkey, encode_header(rec, view, self._key, nonce, size, kind), px=ttl, nx=True)
        won = pipe.execute()[-1]
        if not won:  # lost the race to another writer: its entry stands
            self.client.delete(*chunks)
            self.counts.write_dupes += 1
            return
        if not rec.page_hashes:
            return
        ikey = index_key(self.prefix, self.state_format, rec.page_hashes[-1])
        value = IndexValue(rec.n, rec.nbytes, view.nbytes, nonce, size, len(chunks)).pack()
        pipe = self.client.pipeline(transaction=False)
        pipe.hset(ikey, rec.id, value)
        if ttl is not None:
            pipe.pexpire(ikey, ttl)
        pipe.execute()
        self.counts.writes += 1
        self.counts.written_bytes += view.nbytes

    def _write_pages(self, rec: CheckpointRecord, pages: Sequence[bytes], ttl: int | None
                     ) -> None:
        """Every page of ``rec`` in the store before its header: those there already
        live another ``ttl`` (one round trip), the others are sent."""
        keys = rec.page_keys
        if not keys:
            return
        names = [page_name(self.prefix, self.fingerprint, k) for k in keys]
        pipe = self.client.pipeline(transaction=False)
        for name in names:
            if ttl is None:
                pipe.exists(name)
            else:
                pipe.pexpire(name, ttl)
        there = pipe.execute()
        missing = [i for i, ok in enumerate(there) if not ok]
        self.counts.pages_present += len(keys) - len(missing)
        sent = total = 0
        pipe = self.client.pipeline(transaction=False)
        for i in missing:
            blob = b"".join(encode_page(self._key, keys[i], pages[i], self.page_packer.encode))
            pipe.set(names[i], blob, px=ttl)
            sent += len(blob)
            total += len(blob)
            if sent >= _FETCH_BATCH:
                pipe.execute()
                pipe, sent = self.client.pipeline(transaction=False), 0
        pipe.execute()
        self.counts.pages_written += len(missing)
        self.counts.written_bytes += total

    def _touch(self, hit: RemoteHit, rec: CheckpointRecord) -> None:
        """A hit keeps the entry (its index key and its pages) alive another ``ttl``."""
        ttl = self._ttl()
        if ttl is None:
            return
        pipe = self.client.pipeline(transaction=False)
        pipe.pexpire(header_key(self.prefix, rec.id), ttl)
        for i in range(hit.value.chunks):
            pipe.pexpire(chunk_key(self.prefix, rec.id, hit.value.nonce, i), ttl)
        for k in rec.page_keys:
            pipe.pexpire(page_name(self.prefix, self.fingerprint, k), ttl)
        pipe.pexpire(hit.index_key, ttl)
        pipe.execute()

    def pending(self) -> int:
        with self._lock:
            return len(self._jobs)

    def flush(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for queued jobs to go out (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._jobs or self._busy:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    return False
                self._lock.wait(min(left, 0.05))
            return True

    def close(self, timeout: float = 2.0) -> None:
        """Let queued writes go out for up to ``timeout`` s (none while the store is
        down: shutdown never waits for it), then stop."""
        if self._up:
            self.flush(timeout)
        with self._lock:
            self._stopping = True
            self._jobs.clear()
            self._queued_bytes = 0
            self._queued_pages.clear()
            self._lock.notify_all()
        self._thread.join(timeout)
        try:
            if self._client is not None:
                self._client.close()
        except Exception:
            pass

    def sanity_check(self) -> None:
        """The queue's byte count is what its writes hold, within the bound."""
        with self._lock:
            held, seen = 0, set()
            for kind, w in self._jobs:
                if kind != "write":
                    continue
                held += len(w.rest)
                for k, page in zip(w.record.page_keys, w.pages, strict=True):
                    if k not in seen:
                        seen.add(k)
                        held += len(page)
            if held != self._queued_bytes or held > self.cfg.queue_bytes:
                raise RuntimeError(f"remote: queue holds {held} bytes, counts "
                                   f"{self._queued_bytes}, bound {self.cfg.queue_bytes}")

    def stats(self) -> TierStats:
        with self._lock:
            counts = self.counts.copy()
            counts.up = self._up
            counts.queue = len(self._jobs) + int(self._busy)
            counts.queue_bytes = self._queued_bytes
        return TierStats(self.name, self.label, self.where, self.status, store=counts)
