"""``statecache verify`` (the MAC of every record and page under the key) and
``statecache purge`` (records by age, role or tenant, the pages no record names any
more, quarantined and leftover files; or the shared tier's entries)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from statecache.cli.common import EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE
from statecache.cli.disk import (
    ckpt_files,
    disk_dir,
    leftovers,
    orphan_pages,
    quarantine_note,
    quarantined,
    record_rows,
)
from statecache.cli.inspect import remote_admin


class KeyUnavailable(Exception):
    """The key file cannot be used: nothing on disk can be authenticated."""


def _key(args: argparse.Namespace) -> bytes:
    from statecache.config import load_config
    from statecache.formats.trust import Untrusted, load_key

    path = Path(args.secret_path or load_config(args.config).cache.secret_path).expanduser()
    try:
        return load_key(path, create=False)
    except (Untrusted, OSError) as e:
        raise KeyUnavailable(f"cannot use the key file {path}: {e}") from None


def verify(args: argparse.Namespace) -> int:
    from statecache.formats.diskfmt import SUFFIX, BadFile, read_checkpoint, valid_id

    d = disk_dir(args)
    try:
        key = _key(args)
    except KeyUnavailable as e:
        print(f"statecache: error: {e}; no checkpoint can be verified", file=sys.stderr)
        return EXIT_PROBLEMS
    from statecache.formats.pagefmt import BadPage, decode_page
    from statecache.kvpages import PageKey
    from statecache.tiers.diskfiles import page_path, pages_dir

    ok: list[str] = []
    bad: list[dict[str, str]] = []
    pages: dict[bytes, str] = {}  # page key -> "" when good, else why not
    for path in ckpt_files(d):
        stem = path.name[: -len(SUFFIX)]
        try:
            if path.is_symlink():
                raise BadFile("symlink")
            fm, _ = read_checkpoint(path, key)
            if not valid_id(stem) or fm.id != stem:
                raise BadFile("file name does not match its id")
            keys = fm.meta["keys"]
            where = pages_dir(d, fm.meta["fingerprint"])
            for i in range(0, len(keys), 16):
                k = PageKey(keys[i:i + 16])
                if k not in pages:
                    try:
                        decode_page(key, k, page_path(where, k).read_bytes())
                        pages[k] = ""
                    except (BadPage, OSError) as e:
                        pages[k] = str(e)
                if pages[k]:
                    raise BadFile(f"page {k.hex()}: {pages[k]}")
            ok.append(fm.id)
        except (BadFile, OSError) as e:
            bad.append({"file": path.name, "reason": str(e)})
    moved = quarantined(d)
    if args.json:
        report = {"dir": str(d), "ok": ok, "bad": bad, "quarantined": moved}
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        for b in bad:
            print(f"BAD  {b['file']}: {b['reason']}")
        for q in moved:
            print(f"QUARANTINED  {q['file']}")
        print(f"{len(ok)} ok, {len(bad)} bad in {d}")
        if moved:
            print(quarantine_note(d, moved))
    return EXIT_PROBLEMS if bad else EXIT_OK


def purge(args: argparse.Namespace) -> int:
    from statecache.sizes import format_size, parse_duration

    if not (args.all or args.quarantined or args.older_than or args.role) and (
        args.tenant is None
    ):
        print(
            "statecache: error: purge needs --all, --quarantined, --older-than, --role "
            "or --tenant",
            file=sys.stderr,
        )
        return EXIT_USAGE
    cutoff = time.time() - parse_duration(args.older_than) if args.older_than else None
    if args.remote is not None:
        return _purge_remote(args, cutoff)
    d = disk_dir(args)
    rows, bad = record_rows(d)
    filtered = args.all or args.older_than or args.role or args.tenant is not None
    chosen = [
        r
        for r in rows
        if filtered
        and (cutoff is None or r["created"] < cutoff)
        and (args.role is None or r["role"] == args.role)
        and (args.tenant is None or r["tenant"] == args.tenant)
    ]
    paths = [(Path(r["file"]), r["id"], r["file_bytes"]) for r in chosen]
    if chosen or args.all:  # the KV pages no record left names
        paths += orphan_pages(d, [] if args.all else [r for r in rows if r not in chosen])
    if args.all:
        paths += [(d / b["file"], b["file"], 0) for b in bad]
        paths += leftovers(d)
    if args.all or args.quarantined:
        paths += [(Path(q["path"]), f"quarantine/{q['file']}", q["bytes"]) for q in quarantined(d)]
    verb = "removed" if args.yes else "would remove"
    total = 0
    for path, name, size in paths:
        if args.yes:
            path.unlink(missing_ok=True)
        total += size
        print(f"{verb} {name}")
    print(
        f"{verb} {len(paths)} file(s), {format_size(total)}"
        + ("" if args.yes else " (dry run; pass --yes to delete)")
    )
    return EXIT_OK


def _purge_remote(args: argparse.Namespace, cutoff: float | None) -> int:
    """``purge --remote``: whole entries of the shared tier, by the same filters."""
    from statecache.sizes import format_size

    admin, where = remote_admin(args)
    rows, bad = admin.rows()
    chosen = [r for r in rows
              if (cutoff is None or r["created"] < cutoff)
              and (args.role is None or r["role"] == args.role)
              and (args.tenant is None or r["tenant"] == args.tenant)]
    verb = "removed" if args.yes else "would remove"
    for r in chosen:
        if args.yes:
            admin.delete(r)
        print(f"{verb} {r['id']} (tenant {r['tenant']!r}, n {r['n']})")
    if args.all:
        for b in bad:
            if args.yes:
                admin.delete_key(b["key"])
            print(f"{verb} {b['key']} ({b['reason']})")
    if args.yes and (chosen or (args.all and bad)):
        swept = admin.sweep_pages()
        if swept:
            print(f"removed {swept} KV page(s) no entry names any more")
    total = sum(int(r["nbytes"]) for r in chosen)
    print(f"{verb} {len(chosen) + (len(bad) if args.all else 0)} entr(ies) from {where}, "
          f"{format_size(total)}" + ("" if args.yes else " (dry run; pass --yes to delete)"))
    return EXIT_OK
