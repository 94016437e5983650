"""The shared tier: FULL checkpoints in Redis or Valkey, for several proxies at once.

Never in the way of the engine:

- writes go out on one background thread from a queue bounded in bytes; when the
  store is slower than the engine, the oldest waiting write is dropped;
- a lookup is one pipelined round trip (the prompt's page hashes against the index,
  deepest first) and reads nothing else; the state is fetched only when the planner
  picks it, and its header (key, model, state format, tenant, tokens) and MAC are
  checked before it is used;
- any failure of the store (down, slow, full, a reply that makes no sense) turns the
  tier off for ``retry_s`` with one warning and a counter; it is tried again by
  itself, and says so when it is back.

Layout and checks: ``statecache.remotefmt``. Uses redis-py, which speaks to Valkey too.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from statecache.config import RemoteConfig
from statecache.diskfmt import valid_id
from statecache.pages import PageChain
from statecache.records import CheckpointRecord, Kind, Owner
from statecache.remotefmt import (
    MAX_HEADER_BYTES,
    BadEntry,
    IndexValue,
    assemble,
    chunk_key,
    chunk_views,
    decode_header,
    encode_header,
    header_key,
    index_key,
    n_chunks,
    new_nonce,
)
from statecache.writer import run_in_background

log = logging.getLogger(__name__)

_FETCH_BATCH = 64 << 20  # bytes asked for in one pipeline: bounds a read's extra memory
_CANDIDATES = 4  # remote hits returned by one probe, deepest first
# The store failed, not the entry: a cluster that cannot be reached raises the latter.
_STORE_ERRORS = (redis.RedisError, redis.exceptions.RedisClusterException, OSError)
_COUNTERS = ("probes", "hits", "read_bytes", "rejected", "writes", "written_bytes",
             "write_dupes", "write_drops", "write_skipped", "errors", "reconnects")


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
    def __init__(self, cfg: RemoteConfig, key: bytes, fingerprint: str, *, state_format: int,
                 page_size: int, client: Any = None) -> None:
        self.cfg = cfg
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
        self.counts: collections.Counter[str] = collections.Counter()
        self._jobs: collections.deque[tuple[str, Any]] = collections.deque()
        self._queued_bytes = 0
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
            self.counts["errors"] += 1
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
            self.counts["reconnects"] += 1
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
        self.counts["probes"] += 1
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

    def fetch(self, hit: RemoteHit, tokens: Any, tenant: str
              ) -> tuple[CheckpointRecord, bytearray] | None:
        """The verified state of ``hit``, or None (a miss, counted by its reason)."""
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
            self._check(hit, header.nonce, rec, tokens, tenant)
            parts = list(replies[1:])
            for i in range(per, len(keys), per):
                pipe = self.client.pipeline(transaction=False)
                for k in keys[i:i + per]:
                    pipe.getrange(k, 0, v.chunk_size)
                parts += pipe.execute(raise_on_error=False)
            data = assemble(header, parts, self._key)
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
        self.counts["hits"] += 1
        self.counts["read_bytes"] += rec.nbytes
        self._enqueue(("touch", (hit, rec)), 0)
        return rec, data

    def _check(self, hit: RemoteHit, nonce: bytes, rec: CheckpointRecord, tokens: Any,
               tenant: str) -> None:
        if rec.id != hit.entry_id:
            raise BadEntry("corrupt", "header of another entry")
        if nonce != hit.value.nonce:
            raise BadEntry("stale", "the index names another write of this entry")
        if rec.fingerprint != self.fingerprint:
            raise BadEntry("foreign-model", "written for another model")
        if rec.state_format != self.state_format:
            raise BadEntry("state-format", f"state format {rec.state_format}")
        if rec.tenant != tenant:
            raise BadEntry("tenant", "another tenant's entry")
        if rec.kind is not Kind.FULL or rec.owner is not Owner.TARGET:
            raise BadEntry("corrupt", "not a full target state")
        if rec.n != hit.n or rec.nbytes != hit.nbytes or not rec.matches(tokens):
            raise BadEntry("tokens", "its tokens are not this prompt's")

    def _reject(self, reason: str, detail: str, hit: RemoteHit | None = None) -> None:
        self.counts["rejected"] += 1
        self.counts[f"rejected.{reason}"] += 1
        level = logging.DEBUG if self.counts[f"rejected.{reason}"] > 1 else logging.WARNING
        log.log(level, "remote tier: an entry was refused (%s): %s", reason, detail)
        if hit is not None and reason in ("missing", "stale", "corrupt", "forged"):
            self._enqueue(("forget", hit), 0)  # its index field points at nothing usable

    # -- writes (background) -----------------------------------------------------------

    def put(self, rec: CheckpointRecord, data: bytes) -> None:
        """Queue ``data`` (not copied: pass immutable bytes) for the store."""
        if rec.kind is not Kind.FULL or rec.owner is not Owner.TARGET:
            return
        if rec.nbytes > self.cfg.max_entry or rec.nbytes > self.cfg.queue_bytes:
            self.counts["write_skipped"] += 1
            return
        self._enqueue(("write", (rec, data)), rec.nbytes)

    def _enqueue(self, job: tuple[str, Any], nbytes: int) -> None:
        with self._lock:
            if self._stopping:
                return
            self._jobs.append(job)
            self._queued_bytes += nbytes
            while self._queued_bytes > self.cfg.queue_bytes:
                kind, payload = self._jobs.popleft()
                if kind == "write":
                    self._queued_bytes -= payload[0].nbytes
                    self.counts["write_drops"] += 1
            self._lock.notify_all()

    def _next(self) -> tuple[str, Any] | None:
        with self._lock:
            while True:
                if self._jobs and (self._up or time.monotonic() >= self._retry_at):
                    job = self._jobs.popleft()
                    if job[0] == "write":
                        self._queued_bytes -= job[1][0].nbytes
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
                    self._write(*payload)
                elif kind == "touch":
                    self._touch(*payload)
                else:
                    self.client.hdel(payload.index_key, payload.entry_id)
                self._ok()
            except _STORE_ERRORS as e:
                self._failed(e)
                if kind == "write":  # tried again when the store is back, if still room
                    self._enqueue(job, payload[0].nbytes)
            except Exception:
                log.exception("remote tier: a %s failed", kind)
            finally:
                with self._lock:
                    self._busy = False
                    self._lock.notify_all()

    def _ttl(self) -> int | None:
        return int(self.cfg.ttl * 1000) if self.cfg.ttl > 0 else None

    def _write(self, rec: CheckpointRecord, data: bytes) -> None:
        hkey = header_key(self.prefix, rec.id)
        if self.client.exists(hkey):  # another proxy (or this one) stored it already
            self.counts["write_dupes"] += 1
            return
        view = memoryview(data).cast("B")
        nonce, size = new_nonce(), self.cfg.chunk_size
        ttl = self._ttl()
        pipe = self.client.pipeline(transaction=False)
        chunks = [chunk_key(self.prefix, rec.id, nonce, i)
                  for i in range(n_chunks(rec.nbytes, size))]
        for k, part in zip(chunks, chunk_views(view, size), strict=True):
            pipe.set(k, bytes(part), px=ttl)
        pipe.set(hkey, encode_header(rec, view, self._key, nonce, size), px=ttl, nx=True)
        won = pipe.execute()[-1]
        if not won:  # lost the race to another writer: its entry stands
            self.client.delete(*chunks)
            self.counts["write_dupes"] += 1
            return
        if not rec.page_hashes:
            return
        ikey = index_key(self.prefix, self.state_format, rec.page_hashes[-1])
        value = IndexValue(rec.n, rec.nbytes, nonce, size, len(chunks)).pack()
        pipe = self.client.pipeline(transaction=False)
        pipe.hset(ikey, rec.id, value)
        if ttl is not None:
            pipe.pexpire(ikey, ttl)
        pipe.execute()
        self.counts["writes"] += 1
        self.counts["written_bytes"] += rec.nbytes

    def _touch(self, hit: RemoteHit, rec: CheckpointRecord) -> None:
        """A hit keeps the entry (and its index key) alive another ``ttl``."""
        ttl = self._ttl()
        if ttl is None:
            return
        pipe = self.client.pipeline(transaction=False)
        pipe.pexpire(header_key(self.prefix, rec.id), ttl)
        for i in range(hit.value.chunks):
            pipe.pexpire(chunk_key(self.prefix, rec.id, hit.value.nonce, i), ttl)
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
            held = sum(p[0].nbytes for kind, p in self._jobs if kind == "write")
            if held != self._queued_bytes or held > self.cfg.queue_bytes:
                raise RuntimeError(f"remote: queue holds {held} bytes, counts "
                                   f"{self._queued_bytes}, bound {self.cfg.queue_bytes}")

    def stats(self) -> dict[str, int]:
        with self._lock:
            out = {f"remote_{k}": 0 for k in _COUNTERS}
            out.update(("remote_" + k.replace(".", "_").replace("-", "_"), v)
                       for k, v in self.counts.items())
            out["remote_up"] = int(self._up)
            out["remote_queue"] = len(self._jobs) + int(self._busy)
            out["remote_queue_bytes"] = self._queued_bytes
            return out

    def rejected(self) -> dict[str, int]:
        with self._lock:
            return {k.split(".", 1)[1]: v for k, v in self.counts.items()
                    if k.startswith("rejected.")}
