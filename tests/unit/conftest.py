"""Helpers for the storage tests: real components at tiny sizes (page size 4)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from statecache.config import CacheConfig, RemoteConfig
from statecache.pool import CheckpointPool
from statecache.records import CheckpointRecord, Kind, Owner, Role
from tests.store import Store

FP = "test-model:0123"


class Clock:
    """Deterministic time: each reading is one second after the previous one."""

    def __init__(self, start: float = 1_000_000.0) -> None:
        self.t = start

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


PoolFactory = Callable[..., CheckpointPool]


@pytest.fixture
def make_pool(tmp_path: Path) -> Iterator[PoolFactory]:
    pools: list[CheckpointPool] = []

    def make(
        ram: int = 10_000,
        disk: int | None = 100_000,
        fingerprint: str = FP,
        path: Path | None = None,
        **kw: object,
    ) -> CheckpointPool:
        kw.setdefault("secret_path", str(tmp_path / "keys" / "secret.key"))
        kv_sections = int(kw.pop("kv_sections", 0))  # type: ignore[call-overload]
        cfg = CacheConfig(
            page_size=4,
            ram_budget=ram,
            disk_path=str(path or tmp_path / "ckpt"),
            disk_budget=disk or 0,
            disk_enabled=disk is not None,
            **kw,  # type: ignore[arg-type]
        )
        pool = CheckpointPool(cfg, fingerprint, clock=Clock(), kv_sections=kv_sections)
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        pool.sanity_check()
        pool.close()  # ends its disk writer and unlocks its directory


def put(
    pool: CheckpointPool,
    tokens: list[int],
    data: bytes,
    role: Role = Role.REPLAY,
    kind: Kind = Kind.FULL,
    lane: int | None = None,
) -> CheckpointRecord:
    rec = pool.insert(kind=kind, owner=Owner.TARGET, lane=lane, tokens=tokens, role=role, data=data)
    assert rec is not None
    pool.sanity_check()
    return rec


# -- the shared tier: a real Valkey server and pools that share it ----------------------


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store(tmp_path / "store").start()
    yield s
    s.stop()


@pytest.fixture
def proxy(tmp_path: Path, store: Store) -> Iterator:  # type: ignore[type-arg]
    """A factory of pools ("proxies", each its own RAM and disk) on one store."""
    pools: list[CheckpointPool] = []

    def make(name: str, *, key: str = "shared.key", fingerprint: str = FP,
             tenant: str = "", kv_sections: int = 0, **remote: object) -> CheckpointPool:
        opts: dict[str, object] = {"chunk_size": 4096, "retry_s": 0.2, "timeout": 1.0, **remote}
        rc = RemoteConfig(url=store.url, **opts)  # type: ignore[arg-type]
        cfg = CacheConfig(page_size=4, ram_budget=1 << 20, disk_path=str(tmp_path / name),
                          disk_budget=1 << 20, secret_path=str(tmp_path / "keys" / key),
                          tenant=tenant, remote=rc)
        pool = CheckpointPool(cfg, fingerprint, clock=Clock(), kv_sections=kv_sections)
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        pool.sanity_check()
        pool.close()
