"""The storage half of the `statecache` command: inspect, verify, purge.

This package never imports the proxy: ``proxy.cli`` adds ``serve`` through
``main(argv, commands=...)``, so the arrow runs proxy -> statecache. Imports stay
light at module level so `statecache --help` answers at once; numpy and msgpack
load only inside the subcommands that need them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TextIO

EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE = 0, 1, 2
DEFAULT_URL = "http://127.0.0.1:8080"
ADMIN_KEY_ENV = "STATECACHE_ADMIN_KEY"


# A subcommand added from outside: (set up its parser, run it).
Command = tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]


def _parser(commands: Mapping[str, Command]) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="statecache", description="OpenAI-compatible llama.cpp proxy that reuses model state"
    )
    sub = p.add_subparsers(dest="command", required=True)
    for name, (setup, _run) in commands.items():
        setup(sub.add_parser(name, help=(setup.__doc__ or "").strip() or None))

    i = sub.add_parser("inspect", help="list checkpoints (proxy RAM and disk)")
    i.add_argument("id", nargs="?", help="show one checkpoint (a unique id prefix is enough)")
    i.add_argument("--url", default=DEFAULT_URL, help=f"running proxy (default {DEFAULT_URL})")
    i.add_argument("--admin-key", metavar="KEY",
                   help=f"the proxy's server.admin_key (default: ${ADMIN_KEY_ENV}, "
                        "else from --config)")
    i.add_argument("--misses", action="store_true",
                   help="the proxy's last cache misses and why (GET /admin/misses)")
    _disk_args(i)

    v = sub.add_parser("verify", help="check the MAC of every disk checkpoint")
    _disk_args(v)
    v.add_argument("--secret-path", metavar="FILE", help="key file (default: cache.secret_path)")

    g = sub.add_parser("purge", help="remove disk checkpoints")
    g.add_argument(
        "--all", action="store_true", help="every checkpoint file, quarantined and leftover file"
    )
    g.add_argument("--quarantined", action="store_true", help="the files in quarantine/")
    g.add_argument("--older-than", metavar="AGE", help='created before AGE ago ("2h", "3d")')
    g.add_argument("--role", choices=["end-of-reply", "periodic", "branch", "replay"])
    g.add_argument("--tenant", metavar="T")
    g.add_argument("--yes", action="store_true", help="really delete (default: dry run)")
    _disk_args(g, json_flag=False)
    for sp in (i, g):
        sp.add_argument("--remote", metavar="URL", nargs="?", const="",
                        help="the shared tier too (inspect) or only (purge): a redis:// or "
                             "valkey:// URL; without one, cache.remote.url")
        sp.add_argument("--remote-prefix", metavar="P", help="key prefix (cache.remote.prefix)")
    return p


def _disk_args(p: argparse.ArgumentParser, json_flag: bool = True) -> None:
    p.add_argument("--config", metavar="FILE", help="TOML config (for cache.disk_path)")
    p.add_argument("--disk-path", metavar="DIR", help="checkpoint directory")
    if json_flag:
        p.add_argument("--json", action="store_true", help="machine-readable output")


def main(argv: list[str] | None = None, commands: Mapping[str, Command] | None = None) -> int:
    commands = commands or {}
    try:
        args = _parser(commands).parse_args(argv)
    except SystemExit as e:  # argparse's own --help / usage errors
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    from statecache.config import ConfigError

    try:
        handler: dict[str, Callable[[argparse.Namespace], int]] = {
            "inspect": _inspect, "verify": _verify, "purge": _purge}
        handler.update({name: run for name, (_setup, run) in commands.items()})
        code = handler[args.command](args)
        sys.stdout.flush()  # a closed pipe shows here, not at exit
        return code
    except (ConfigError, ValueError) as e:
        print(f"statecache: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:
        # The reader left (`statecache inspect | head`): stop quietly. Python would
        # complain again when it flushes stdout at exit, so point stdout at /dev/null.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_OK


# -- disk helpers ------------------------------------------------------------------------


def _proxy_dir(args: argparse.Namespace, told: Mapping[str, Any]) -> Path | None:
    """--disk-path, else the directory of the proxy that answered (None: it has no disk
    tier), else the config's."""
    if not args.disk_path and "disk_path" in told:
        return Path(told["disk_path"]) if isinstance(told["disk_path"], str) else None
    return _disk_dir(args)


def _disk_dir(args: argparse.Namespace) -> Path:
    if args.disk_path:
        return Path(args.disk_path).expanduser()
    from statecache.config import load_config

    return Path(load_config(args.config).cache.disk_path).expanduser()


def _ckpt_files(d: Path) -> Iterator[Path]:
    from statecache.formats.diskfmt import SUFFIX, TMP_PREFIX

    if not d.is_dir():
        return
    for entry in sorted(os.scandir(d), key=lambda e: e.name):
        if entry.name.endswith(SUFFIX) and not entry.name.startswith(TMP_PREFIX):
            yield Path(entry.path)


def _quarantined(d: Path) -> list[dict[str, Any]]:
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


def _quarantine_note(d: Path, quarantined: list[dict[str, Any]]) -> str:
    from statecache.sizes import format_size

    total = format_size(sum(q["bytes"] for q in quarantined))
    return (
        f"{len(quarantined)} quarantined file(s), {total}, in {d / 'quarantine'}; "
        "`statecache purge --quarantined --yes` removes them"
    )


def _disk_rows(d: Path) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    """Rows for valid-looking files (header + metadata only) and the unreadable ones."""
    from statecache.formats.diskfmt import BadFile, read_meta

    rows: list[dict[str, Any]] = []
    bad: list[dict[str, str]] = []
    for path in _ckpt_files(d):
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
                "tiers": ["disk"],
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


def _page_files(d: Path) -> Iterator[tuple[Path, str]]:
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


def _orphan_pages(d: Path, keep: list[dict[str, Any]]) -> list[tuple[Path, str, int]]:
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
        for path, name in _page_files(d):
            if name not in named:
                out.append((path, f"{path.parent.parent.name}/{name}",
                            path.stat(follow_symlinks=False).st_size))
        return out
    finally:
        lock.release()


# -- inspect -----------------------------------------------------------------------------


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


def _inspect(args: argparse.Namespace) -> int:
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
    d = _proxy_dir(args, told)
    disk_rows, bad = _disk_rows(d) if d is not None else ([], [])
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
        from statecache.tiers.remoteadmin import public

        admin, where = _remote_admin(args)
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
            row["tiers"] = sorted(set(row.get("tiers", [])) | {"remote"}, reverse=True)
            row["ttl_s"] = r["ttl_s"]
        if remote_bad:
            notes.append(f"{len(remote_bad)} unreadable entr(ies) in the remote tier {where}")
    for r in proxy_rows:
        if not isinstance(r, dict) or not isinstance(r.get("id"), str):
            continue
        row = merged.setdefault(r["id"], {})
        tiers = sorted(set(row.get("tiers", [])) | set(r.get("tiers", ["ram"])), reverse=True)
        row.update(r, tiers=tiers)
    if bad:
        notes.append(f"{len(bad)} unreadable file(s) in {d}; run `statecache verify`")
    quarantined = _quarantined(d) if d is not None else []
    if d is None:
        notes.append(f"the proxy at {url} has no disk tier ({told.get('disk')})")
    elif quarantined:
        notes.append(_quarantine_note(d, quarantined))
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
            {"checkpoints": rows, "bad": bad, "quarantined": quarantined, "notes": notes},
            out,
            indent=2,
        )
        out.write("\n")
    else:
        for note in notes:
            print(note, file=out)
        _table(rows, out)
    return EXIT_OK


def _remote_admin(args: argparse.Namespace) -> tuple[Any, str]:
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


# -- verify / purge ----------------------------------------------------------------------


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


def _verify(args: argparse.Namespace) -> int:
    from statecache.formats.diskfmt import SUFFIX, BadFile, read_checkpoint, valid_id

    d = _disk_dir(args)
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
    for path in _ckpt_files(d):
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
    quarantined = _quarantined(d)
    if args.json:
        report = {"dir": str(d), "ok": ok, "bad": bad, "quarantined": quarantined}
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        for b in bad:
            print(f"BAD  {b['file']}: {b['reason']}")
        for q in quarantined:
            print(f"QUARANTINED  {q['file']}")
        print(f"{len(ok)} ok, {len(bad)} bad in {d}")
        if quarantined:
            print(_quarantine_note(d, quarantined))
    return EXIT_PROBLEMS if bad else EXIT_OK


def _leftovers(d: Path) -> list[tuple[Path, str, int]]:
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


def _purge(args: argparse.Namespace) -> int:
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
    d = _disk_dir(args)
    rows, bad = _disk_rows(d)
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
        paths += _orphan_pages(d, [] if args.all else [r for r in rows if r not in chosen])
    if args.all:
        paths += [(d / b["file"], b["file"], 0) for b in bad]
        paths += _leftovers(d)
    if args.all or args.quarantined:
        paths += [(Path(q["path"]), f"quarantine/{q['file']}", q["bytes"]) for q in _quarantined(d)]
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

    admin, where = _remote_admin(args)
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
