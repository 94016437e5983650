"""The `statecache` command's parser and ``main``: inspect (inspect.py), verify and purge
(purge.py), and any command the proxy adds (``serve``)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping

from statecache.cli import inspect, purge
from statecache.cli.common import ADMIN_KEY_ENV, DEFAULT_URL, EXIT_OK, EXIT_USAGE

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
            "inspect": inspect.inspect, "verify": purge.verify, "purge": purge.purge}
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


