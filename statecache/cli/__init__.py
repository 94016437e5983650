"""The storage half of the `statecache` command: inspect, verify, purge (main.py).

This package never imports the proxy: ``proxy.cli`` adds ``serve`` through
``main(argv, commands=...)``, so the arrow runs proxy -> statecache. Imports stay
light at module level so `statecache --help` answers at once; numpy and msgpack
load only inside the subcommands that need them.
"""

from statecache.cli.common import EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE
from statecache.cli.main import Command, main

__all__ = ["EXIT_OK", "EXIT_PROBLEMS", "EXIT_USAGE", "Command", "main"]
