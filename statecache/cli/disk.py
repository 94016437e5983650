"""The checkpoint directory as the storage commands read it: record files by their
header and metadata alone (nothing authenticated: a listing, never a state), page
files, quarantined files and leftovers of interrupted writes."""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any


def proxy_dir(args: argparse.Namespace, told: Mapping[str, Any]) -> Path | None:
    """--disk-path, else the directory of the proxy that answered (None: it has no disk
    tier), else the config's."""
    if not args.disk_path and "disk_path" in told:
        return Path(told["disk_path"]) if isinstance(told["disk_path"], str) else None
    return disk_dir(args)


def disk_dir(args: argparse.Namespace) -> Path:
    if args.disk_path:
        return Path(args.disk_path).expanduser()
    from statecache.config import load_config

    return Path(load_config(args.config).cache.disk_path).expanduser()


def ckpt_files(d: Path) -> Iterator[Path]:
    from statecache.formats.diskfmt import SUFFIX, TMP_PREFIX

    if not d.is_dir():
        return
    for entry in sorted(os.scandir(d), key=lambda e: e.name):
        if entry.name.endswith(SUFFIX) and not entry.name.startswith(TMP_PREFIX):
            yield Path(entry.path)


def quarantined(d: Path) -> list[dict[str, Any]]:
    """Files moved aside by the proxy: never served, kept for a look until purged."""
    from statecache.tiers.diskfiles import QUARANTINE

    q = d / QUARANTINE
    if not q.is_dir():
        return []
    out = []
    for entry in sorted(os.scandir(q), key=lambda e: e.name):
        st = entry.stat(follow_symlinks=False)
        out.append(
            {"file": entry.name, "bytes": st.st_size, "since": st.st_mtime, "path": entry.path}
        )
    return out


def quarantine_note(d: Path, quarantined: list[dict[str, Any]]) -> str:
    from statecache.sizes import format_size

    total = format_size(sum(q["bytes"] for q in quarantined))
    return (
        f"{len(quarantined)} quarantined file(s), {total}, in {d / 'quarantine'}; "
        "`statecache purge --quarantined --yes` removes them"
    )


def record_rows(d: Path) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    """Rows for valid-looking files (header + metadata only) and the unreadable ones."""
    from statecache.formats.diskfmt import BadFile, read_meta
    from statecache.tiers.disk import DiskTier

    rows: list[dict[str, Any]] = []
    bad: list[dict[str, str]] = []
    for path in ckpt_files(d):
        try:
            fm = read_meta(path)
        except (BadFile, OSError) as e:
            bad.append({"file": path.name, "reason": str(e)})
            continue
        m = fm.meta
        rows.append(
            {
                "id": m["id"],
                "kind": m["kind"],
                "owner": m["owner"],
                "lane": m["lane"],
                "role": m["role"],
                "n": m["n"],
                "nbytes": m["nbytes"],
                "file_bytes": fm.file_size,
                "created": m["created"],
                "last_used": fm.mtime,
                "hits": None,
                "tiers": [DiskTier.name],
                "preview": m["preview"],
                "fingerprint": m["fingerprint"],
                "tenant": m["tenant"],
                "state_format": m["state_format"],
                "kv_pages": len(m["keys"]) // 16,
                "rest_nbytes": m["rest"],
                "file": str(path),
                "_keys": m["keys"],
            }
        )
    return rows, bad


def page_files(d: Path) -> Iterator[tuple[Path, str]]:
    """Every KV page file under ``d`` (any model's) and its key in hex."""
    from statecache.tiers.diskfiles import PAGE_SUFFIX

    if not d.is_dir():
        return
    for top in os.scandir(d):
        if not top.name.startswith("pages-") or not top.is_dir(follow_symlinks=False):
            continue
        for sub in os.scandir(top.path):
            if not sub.is_dir(follow_symlinks=False):
                continue
            for e in os.scandir(sub.path):
                if e.name.endswith(PAGE_SUFFIX):
                    yield Path(e.path), e.name[: -len(PAGE_SUFFIX)]


def orphan_pages(d: Path, keep: list[dict[str, Any]]) -> list[tuple[Path, str, int]]:
    """Page files no record of ``keep`` names, if no proxy holds the directory now (a
    running proxy's pages may belong to a record it is writing)."""
    from statecache.tiers.dirlock import Busy, DirLock

    if not d.is_dir():
        return []
    try:
        lock = DirLock(d)
    except (Busy, OSError):
        return []
    try:
        named = {r["_keys"][i:i + 16].hex() for r in keep for i in range(0, len(r["_keys"]), 16)}
        out = []
        for path, name in page_files(d):
            if name not in named:
                out.append((path, f"{path.parent.parent.name}/{name}",
                            path.stat(follow_symlinks=False).st_size))
        return out
    finally:
        lock.release()


def leftovers(d: Path) -> list[tuple[Path, str, int]]:
    """Temporary files of interrupted writes, if no proxy holds the directory now."""
    from statecache.formats.diskfmt import TMP_PREFIX
    from statecache.tiers.dirlock import Busy, DirLock

    if not d.is_dir():
        return []
    try:
        lock = DirLock(d)
    except (Busy, OSError):
        return []  # a running proxy's temporary files are writes in progress
    try:
        return [
            (Path(e.path), e.name, e.stat(follow_symlinks=False).st_size)
            for e in os.scandir(d)
            if e.name.startswith(TMP_PREFIX)
        ]
    finally:
        lock.release()


