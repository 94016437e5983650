"""The link to the shared store: a redis-py client made on first use, and whether the
store answers. Any failure turns the tier off for ``retry_s`` with one warning and a
counter; it is tried again by itself and says when it is back. The tier's lookups and
its writer share the link (its lock, its health, its counts).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from statecache.config import RemoteConfig
from statecache.tiers.tier import StoreStats

log = logging.getLogger(__name__)


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


class Link:
    def __init__(self, cfg: RemoteConfig, client: Any = None) -> None:
        self.cfg = cfg
        self.where = where(cfg.url)
        self._client = client
        self.lock = threading.Condition()  # health, the write queue, the counts
        self.up = True
        self.retry_at = 0.0
        self.counts = StoreStats()

    @property
    def client(self) -> Any:
        if self._client is None:  # a cluster client talks to the cluster as it is made
            self._client = connect(self.cfg.url, cluster=self.cfg.cluster,
                                   timeout=self.cfg.timeout)
        return self._client

    def usable(self) -> bool:
        """Up, or down long enough to be tried again."""
        with self.lock:
            return self.up or time.monotonic() >= self.retry_at

    @property
    def status(self) -> str:
        return f"ok ({self.where})" if self.up else f"unreachable ({self.where}), retrying"

    def ping(self) -> bool:
        try:
            self.client.ping()
        except Exception as e:
            self.failed(e)
            return False
        self.ok()
        return True

    def failed(self, e: BaseException) -> None:
        with self.lock:
            self.counts.errors += 1
            self.retry_at = time.monotonic() + self.cfg.retry_s
            was_up, self.up = self.up, False
        if was_up:
            log.warning("remote tier %s: %s: %s; serving from RAM and disk, retrying every "
                        "%g s", self.where, type(e).__name__, e, self.cfg.retry_s)
        else:
            log.debug("remote tier %s still failing: %s", self.where, e)

    def ok(self) -> None:
        with self.lock:
            was_up, self.up = self.up, True
        if not was_up:
            self.counts.reconnects += 1
            log.warning("remote tier %s: reachable again", self.where)

    def close(self) -> None:
        try:
            if self._client is not None:
                self._client.close()
        except Exception:
            pass
