"""What the storage commands share: their exit codes, the proxy they ask, where its
admin key comes from."""

from __future__ import annotations

EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE = 0, 1, 2
DEFAULT_URL = "http://127.0.0.1:8080"
ADMIN_KEY_ENV = "STATECACHE_ADMIN_KEY"
