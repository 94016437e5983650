"""``statecache inspect``: the checkpoints of a running proxy (RAM, disk) merged with
the files of its directory and, with ``--remote``, the shared tier's entries; and
``inspect --misses``, the proxy's last misses and why."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, TextIO

from statecache.cli.common import ADMIN_KEY_ENV, EXIT_OK, EXIT_PROBLEMS
from statecache.cli.disk import proxy_dir, quarantine_note, quarantined, record_rows


def _fetch(url: str, key: str = "") -> Any:
    import urllib.error
    import urllib.request

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers),
                                    timeout=2.0) as resp:
            return json.load(resp)
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return None
        if e.code in (401, 403):
            raise PermissionError(f"HTTP {e.code}: the admin key is missing or wrong "
                          f"(--admin-key or ${ADMIN_KEY_ENV})") from None
        raise OSError(f"HTTP {e.code}") from None
    except (urllib.error.URLError, TimeoutError, ValueError) as e:
        raise OSError(str(e)) from None


def _admin_key(args: argparse.Namespace) -> str:
    if args.admin_key or os.environ.get(ADMIN_KEY_ENV):
        return str(args.admin_key or os.environ[ADMIN_KEY_ENV])
    if not args.config:
        return ""
    from statecache.config import load_config

    return load_config(args.config).server.admin_key


def inspect(args: argparse.Namespace) -> int:
    url = args.url.rstrip("/")
    if args.misses:
        return _misses(args, url)
    notes: list[str] = []
    told: dict[str, Any] = {}  # the proxy's model, fingerprint and disk directory
    try:
        told = _fetch(f"{url}/admin/checkpoints", _admin_key(args)) or {}
    except PermissionError as e:
        notes.append(f"proxy at {url} refused ({e}); showing disk only")
    except OSError:
        notes.append(f"proxy not reachable at {url}; showing disk only")
    proxy_rows: list[dict[str, Any]] = told.get("checkpoints", [])
    d = proxy_dir(args, told)
    disk_rows, bad = record_rows(d) if d is not None else ([], [])
    fingerprint = told.get("fingerprint")
    if isinstance(fingerprint, str):  # that proxy's model only, named
        others = [r for r in disk_rows if r["fingerprint"] != fingerprint]
        if others:
            notes.append(f"{len(others)} checkpoint(s) of other models in {d} left out")
        disk_rows = [r for r in disk_rows if r["fingerprint"] == fingerprint]
        for r in (*disk_rows, *proxy_rows):
            if isinstance(r, dict) and r.get("fingerprint") == fingerprint:
                r["model"] = told.get("model")
    merged: dict[str, dict[str, Any]] = {
        r["id"]: {k: v for k, v in r.items() if not k.startswith("_")} for r in disk_rows}
    if args.remote is not None:
        from statecache.tiers.remote import RemoteTier
        from statecache.tiers.remoteadmin import public

        admin, where = remote_admin(args)
        try:
            remote_rows, remote_bad = admin.rows()
        except Exception as e:  # redis-py's errors and a store that answers nonsense
            remote_rows, remote_bad = [], []
            notes.append(f"remote tier {where} not readable: {type(e).__name__}: {e}")
        for r in remote_rows:
            if r["id"] not in merged:
                merged[r["id"]] = public(r)
                continue
            row = merged[r["id"]]
            row["tiers"] = sorted(set(row.get("tiers", [])) | {RemoteTier.name}, reverse=True)
            row["ttl_s"] = r["ttl_s"]
        if remote_bad:
            notes.append(f"{len(remote_bad)} unreadable entr(ies) in the remote tier {where}")
    from statecache.tiers.ram import RamTier

    for r in proxy_rows:
        if not isinstance(r, dict) or not isinstance(r.get("id"), str):
            continue
        row = merged.setdefault(r["id"], {})
        tiers = sorted(set(row.get("tiers", [])) | set(r.get("tiers", [RamTier.name])),
                       reverse=True)
        row.update(r, tiers=tiers)
    if bad:
        notes.append(f"{len(bad)} unreadable file(s) in {d}; run `statecache verify`")
    moved = quarantined(d) if d is not None else []
    if d is None:
        notes.append(f"the proxy at {url} has no disk tier ({told.get('disk')})")
    elif moved:
        notes.append(quarantine_note(d, moved))
    out = sys.stdout
    if args.id:
        matches = [i for i in merged if i.startswith(args.id.lower())]
        if len(matches) != 1:
            what = "no checkpoint" if not matches else f"{len(matches)} checkpoints"
            print(f"statecache: error: {what} match {args.id!r}", file=sys.stderr)
            return EXIT_PROBLEMS
        row = merged[matches[0]]
        if args.json:
            json.dump(row, out, indent=2)
            out.write("\n")
        else:
            for k, v in row.items():
                print(f"{k:>13}: {v}", file=out)
        return EXIT_OK
    rows = sorted(merged.values(), key=lambda r: r.get("last_used") or 0, reverse=True)
    if args.json:
        json.dump(
            {"checkpoints": rows, "bad": bad, "quarantined": moved, "notes": notes},
            out,
            indent=2,
        )
        out.write("\n")
    else:
        for note in notes:
            print(note, file=out)
        _table(rows, out)
    return EXIT_OK


def remote_admin(args: argparse.Namespace) -> tuple[Any, str]:
    from statecache.config import load_config
    from statecache.tiers.remoteadmin import RemoteAdmin
    from statecache.tiers.remotelink import where

    cfg = load_config(args.config).cache
    url = args.remote or cfg.remote.url
    if not url:
        raise ValueError("--remote needs a URL (or cache.remote.url in the config)")
    prefix = args.remote_prefix or cfg.remote.prefix
    return RemoteAdmin(url, prefix=prefix, cluster=cfg.remote.cluster,
                       page_size=cfg.page_size), where(url)


def _count(v: object) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) else -1


def _misses(args: argparse.Namespace, url: str) -> int:
    """The proxy's recent misses, newest first; they live in its memory only."""
    try:
        body = _fetch(f"{url}/admin/misses", _admin_key(args))
    except (PermissionError, OSError) as e:
        print(f"statecache: error: proxy at {url}: {e}", file=sys.stderr)
        return EXIT_PROBLEMS
    if not isinstance(body, dict):
        print(f"statecache: error: proxy at {url} has no /admin/misses (admin routes off?)",
              file=sys.stderr)
        return EXIT_PROBLEMS
    rows = [r for r in body.get("misses", []) if isinstance(r, dict)]
    out = sys.stdout
    if args.json:
        json.dump({"misses": rows}, out, indent=2, ensure_ascii=False)
        out.write("\n")
        return EXIT_OK
    for r in rows:
        when = time.strftime("%H:%M:%S", time.localtime(float(r.get("time") or 0)))
        token, message = _count(r.get("token")), _count(r.get("message"))
        where = f" at token {token:,}" if token >= 0 else ""
        if message >= 0:
            where += f" (message {message}, {r.get('role') or '?'})"
        text = f": {r.get('old', '')!r} -> {r.get('new', '')!r}" if r.get("old") or \
            r.get("new") else ""
        print(f"{when}  {r.get('request_id', '')}  tenant {r.get('tenant', '')!r}  "
              f"reused {max(_count(r.get('reused')), 0):,} of "
              f"{max(_count(r.get('known')), 0):,}  {r.get('cause', '?')}{where}{text}",
              file=out)
    print(f"{len(rows)} miss(es)", file=out)
    return EXIT_OK


def _table(rows: list[dict[str, Any]], out: TextIO) -> None:
    from statecache.sizes import format_age, format_size

    now = time.time()
    head = ("ID", "KIND", "ROLE", "N", "SIZE", "AGE", "HITS", "TIER", "PREVIEW")
    lines = [head]
    for r in rows:
        hits = r.get("hits")
        role = str(r.get("role", ""))
        kept = float(r.get("kept_until") or 0)
        if kept > now:  # a client's cache breakpoint keeps it this much longer
            role += f" (kept {format_age(kept - now)})"
        lines.append(
            (
                str(r.get("id", ""))[:12],
                str(r.get("kind", "")),
                role,
                str(r.get("n", "")),
                format_size(int(r.get("nbytes") or 0)),
                format_age(now - float(r.get("created") or now)),
                "-" if hits is None else str(hits),
                "+".join(r.get("tiers", [])),
                repr(str(r.get("preview", ""))[-40:]),
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    for line in lines:
        print("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip(), file=out)
    print(f"{len(rows)} checkpoint(s)", file=out)


