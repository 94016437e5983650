"""The shared tier: FULL checkpoints in Redis or Valkey, for several proxies at once.

Never in the way of the engine:

- writes go out on one background thread from a queue bounded in bytes; when the
  store is slower than the engine, the oldest waiting write is dropped;
- a lookup is one pipelined round trip (the prompt's page hashes against the index,
  deepest first) and reads nothing else; an index entry whose tokens past its last
  page differ (``tail_hash``) or that was refused before is passed over; the state is
  fetched only when the planner picks it: its header first (key, model, state format,
  tenant, tokens, MAC), the state's bytes only once that is checked; of its KV pages,
  only those the local tiers lack are fetched, and a write sends the pages the store
  lacks or this proxy never verified there;
- what fails its check under our key is ours to heal: a header, or the header of an
  entry whose chunk or page is bad or gone, and a bad page, are deleted (if they still
  hold the bytes that failed), so the next writer that holds the state writes it again;
- any failure of the store (down, slow, full, a reply that makes no sense) turns the
  tier off for ``retry_s`` with one warning and a counter; it is tried again by
  itself, and says so when it is back.

Here: lookups and checks. The client and the store's health: tiers/remotelink.py;
what goes out: tiers/remotewrites.py. Layout and checks: statecache/formats/remotefmt.py.
Uses redis-py, which speaks to Valkey too.
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from statecache.buffers import Buffer
from statecache.config import RemoteConfig
from statecache.formats import codec
from statecache.formats.diskfmt import valid_id
from statecache.formats.pagefmt import BadPage, decode_page
from statecache.formats.remotefmt import (
    MAX_HEADER_BYTES,
    BadEntry,
    Header,
    IndexValue,
    chunk_key,
    decode_header,
    header_key,
    index_key,
    join_rest,
    page_name,
    space,
    tail_hash,
)
from statecache.kvpages import PageKey
from statecache.pages import PageChain
from statecache.records import CheckpointRecord, Kind, Owner
from statecache.tiers.remotelink import Link
from statecache.tiers.remotewrites import PIPELINE_BYTES, STORE_ERRORS, Outgoing
from statecache.tiers.tier import LocalPages, PageSource, TierStats

log = logging.getLogger(__name__)

_CANDIDATES = 4  # remote hits returned by one probe, deepest first
_REMEMBERED = 4096  # entries (id, nonce) refused for what they are: never fetched again
# an entry refused for these is what it says it is, for another prompt: passed over after
_NOT_OURS = frozenset({"tokens", "tenant", "foreign_model", "state_format", "too_big"})
# a header, or its entry's chunk or page, proved bad or gone: the header is deleted so
# the next writer of the entry writes it whole again
_BROKEN = frozenset({"missing", "corrupt", "forged", "foreign_key", "version"})


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


class RemoteTier:
    name = "remote"
    label = "Shared store"
    prior_bandwidth: float | None = 2e8  # bytes/s, read and checked, until measured

    def __init__(self, cfg: RemoteConfig, key: bytes, fingerprint: str, *, state_format: int,
                 page_size: int, client: Any = None, level: int = codec.DEFAULT_LEVEL) -> None:
        self.cfg = cfg
        self.prefix = cfg.prefix
        self.space = space(cfg.prefix, key)  # every key name this tier reads or writes
        self._key = key
        self._refused: OrderedDict[tuple[str, bytes], None] = OrderedDict()
        self.fingerprint = fingerprint
        self.state_format = state_format
        self.page_size = page_size
        self.link = Link(cfg, client)
        self.where = self.link.where
        self.counts = self.link.counts
        self.out = Outgoing(self.link, key, fingerprint, state_format=state_format, level=level,
                            page_size=page_size)

    @property
    def client(self) -> Any:
        return self.link.client

    def usable(self) -> bool:
        return self.link.usable()

    @property
    def status(self) -> str:
        return self.link.status

    def ping(self) -> bool:
        return self.link.ping()

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
        keys = [index_key(self.space, self.state_format, chain.hashes[k - 1])
                for k in range(hi, lo - 1, -1)]
        try:
            pipe = self.client.pipeline(transaction=False)
            for k in keys:
                pipe.hgetall(k)
            replies = pipe.execute(raise_on_error=False)
        except Exception as e:
            self.link.failed(e)
            return []
        self.link.ok()
        self.counts.probes += 1
        hits: list[RemoteHit] = []
        tokens = np.ascontiguousarray(chain.tokens, dtype="<i4").data.cast("B")
        for key, reply in zip(keys, replies, strict=True):
            if not isinstance(reply, dict):  # a WRONGTYPE error, say: some other key
                self._reject("index", f"index reply is not a hash: {reply!r:.80}")
                continue
            for field, raw in reply.items():
                hit = self._parse_hit(key, field, raw, tokens, page, min_n, max_n)
                if hit is not None:
                    hits.append(hit)
        hits.sort(key=lambda h: h.n, reverse=True)
        return hits[:_CANDIDATES]

    def _parse_hit(self, key: str, field: object, raw: object, tokens: memoryview, page: int,
                   min_n: int, max_n: int) -> RemoteHit | None:
        try:
            entry_id = field.decode() if isinstance(field, bytes) else ""
            if not valid_id(entry_id):
                raise BadEntry("index", "not an entry id")
            value = IndexValue.unpack(raw, self.cfg.max_entry)
        except (BadEntry, UnicodeDecodeError) as e:
            self._reject(getattr(e, "reason", "index"), str(e))
            return None
        if not min_n < value.n <= max_n or value.tail != tail_hash(tokens, value.n, page):
            return None  # a longer or shorter entry ending in this page, or other tokens
        if (entry_id, value.nonce) in self._refused:
            self.counts.skipped += 1
            return None
        return RemoteHit(entry_id, key, value)

    def fetch(self, hit: RemoteHit, tokens: Any, tenant: str,
              local: LocalPages | None = None
              ) -> tuple[CheckpointRecord, Buffer, list[Buffer]] | None:
        """The verified rest and pages of ``hit``, or None (a miss, counted by its reason).
        Pages ``local`` gives are not fetched."""
        if not self.usable():
            return None
        v = hit.value
        keys = [chunk_key(self.space, hit.entry_id, v.nonce, i) for i in range(v.chunks)]
        per = max(1, PIPELINE_BYTES // v.chunk_size)
        hkey = header_key(self.space, hit.entry_id)
        try:  # the header alone first: no state byte is read for an entry it refuses
            raw = self.client.getrange(hkey, 0, MAX_HEADER_BYTES)
        except Exception as e:
            self.link.failed(e)
            return None
        try:
            header = decode_header(raw, self._key, self.page_size)
            rec = header.record
            self._check(hit, header, rec, tokens, tenant)
            parts: list[object] = []
            for i in range(0, len(keys), per):
                pipe = self.client.pipeline(transaction=False)
                for k in keys[i:i + per]:
                    pipe.getrange(k, 0, v.chunk_size)
                parts += pipe.execute(raise_on_error=False)
            rest = join_rest(header, parts, self._key)
            pages = self._fetch_pages(rec, local)
        except BadEntry as e:
            self._reject(e.reason, str(e), hit, (hkey, raw))
            return None
        except STORE_ERRORS as e:
            self.link.failed(e)
            return None
        except Exception as e:  # a reply of an unexpected shape: never a crash
            self._reject("corrupt", f"{type(e).__name__}: {e}", hit, (hkey, raw))
            return None
        self.link.ok()
        self.counts.hits += 1
        self.counts.read_bytes += header.stored
        self.out.enqueue(("touch", (hit, rec)))
        return rec, rest, pages

    def _fetch_pages(self, rec: CheckpointRecord, local: LocalPages | None) -> list[Buffer]:
        """``rec``'s pages: the local ones as given, the others from the store (in
        batches of at most PIPELINE_BYTES bytes), each checked; raises BadEntry."""
        keys = rec.page_keys
        have = local(keys) if local is not None and keys else {}
        want = [i for i in range(len(keys)) if i not in have]
        self.counts.pages_local += len(have)
        out: dict[int, Buffer] = dict(have)
        batch = max(1, PIPELINE_BYTES // max(1, rec.nbytes // max(1, len(keys))))
        for at in range(0, len(want), batch):
            pipe = self.client.pipeline(transaction=False)
            for i in want[at:at + batch]:
                pipe.get(page_name(self.space, self.fingerprint, keys[i]))
            for i, blob in zip(want[at:at + batch], pipe.execute(raise_on_error=False),
                               strict=True):
                self._page_of(rec, keys[i], blob, out, i)
        self.counts.pages_fetched += len(want)
        return [out[i] for i in range(len(keys))]

    def _page_of(self, rec: CheckpointRecord, key: PageKey, blob: object,
                 out: dict[int, Buffer], i: int) -> None:
        """Check one fetched page into ``out[i]``; a page gone or bad is named in a
        warning, forgotten as verified, and deleted if bad; raises BadEntry."""
        name = page_name(self.space, self.fingerprint, key)
        why: BadEntry | None = None
        if not isinstance(blob, bytes):
            why = BadEntry("missing", f"page {key.hex()} is not in the store")
        else:
            try:
                out[i] = decode_page(self._key, key, blob)
            except BadPage as e:
                why = BadEntry(e.reason, f"page {key.hex()}: {e}")
                self.out.enqueue(("delete", (name, _digest(blob), len(blob))))
        if why is None:
            self.out.verified(key)
            self.counts.read_bytes += len(blob)  # type: ignore[arg-type]
            return
        self.out.unverified(key)
        log.warning("remote tier: page %s %s: 1 checkpoint dropped (%s)", key.hex(),
                    "is missing" if why.reason == "missing" else f"was refused ({why})",
                    rec.id)
        raise why

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

    def _reject(self, reason: str, detail: str, hit: RemoteHit | None = None,
                header: tuple[str, object] | None = None) -> None:
        """Count a refusal; remember an entry that is another prompt's, forget one that
        points at nothing usable, delete a header of ours that is bad or whose entry is."""
        level = logging.DEBUG if self.counts.refused(reason) > 1 else logging.WARNING
        log.log(level, "remote tier: an entry was refused (%s): %s", reason, detail)
        if hit is None:
            return
        if reason in _NOT_OURS:
            self._refused[(hit.entry_id, hit.value.nonce)] = None
            while len(self._refused) > _REMEMBERED:
                self._refused.popitem(last=False)
        if reason in _BROKEN or reason == "stale":
            self.out.enqueue(("forget", hit))  # its index field points at nothing usable
        raw = header[1] if header is not None else None
        if reason in _BROKEN and header is not None and isinstance(raw, bytes) and raw:
            self.out.enqueue(("delete", (header[0], _digest(raw), len(raw))))

    # -- writes (background) -----------------------------------------------------------

    def put(self, rec: CheckpointRecord, rest: bytes, page: PageSource | None = None
            ) -> None:
        """Queue ``rest`` (not copied: pass immutable bytes) and the pages ``page`` gives
        for the store."""
        if rec.kind is not Kind.FULL or rec.owner is not Owner.TARGET:
            return
        if rec.nbytes > self.cfg.max_entry or rec.nbytes > self.cfg.queue_bytes:
            self.counts.write_skipped += 1
            return
        self.out.write(rec, rest, page)

    def pending(self) -> int:
        return self.out.queued()[0]

    def hold(self, on: bool) -> None:
        """The engine prefills (``on``) or no longer does: writes wait meanwhile."""
        self.out.hold(on)

    def flush(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for queued jobs to go out (tests, shutdown)."""
        return self.out.flush(timeout)

    def close(self, timeout: float = 2.0) -> None:
        """Let queued writes go out for up to ``timeout`` s (none while the store is
        down: shutdown never waits for it), then stop."""
        self.out.close(timeout)

    def sanity_check(self) -> None:
        """The write queue's byte count is what its writes hold, within the bound."""
        self.out.sanity_check()

    @classmethod
    def off(cls, why: str) -> TierStats:
        """The figures of a shared tier that is off: nothing read from it."""
        return TierStats(cls.name, cls.label, status=why, bandwidth=0.0)

    def stats(self) -> TierStats:
        queue, queue_bytes = self.out.queued()
        with self.link.lock:
            counts = self.counts.copy()
            counts.up = self.link.up
        counts.queue, counts.queue_bytes = queue, queue_bytes
        return TierStats(self.name, self.label, self.where, self.status, store=counts)


def _digest(blob: bytes) -> str:
    """What a conditional delete compares: the SHA-1 the store's script computes."""
    return hashlib.sha1(blob, usedforsecurity=False).hexdigest()
