"""`python -m proxy`: the whole `statecache` command, ``serve`` included."""

from __future__ import annotations

import sys

from proxy.cli import main

sys.exit(main())
