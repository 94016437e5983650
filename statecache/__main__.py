"""`python -m statecache`."""

from __future__ import annotations

import sys

from statecache.cli import main

sys.exit(main())
