"""Opening the disk tier: the checks that decide whether a directory may be used at all.

Any failure turns the disk tier off with one line saying why (logged once by the pool),
never a crash and never a warning per write.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

from statecache.config import CacheConfig
from statecache.formats.trust import Untrusted, check_key_outside, load_key, make_private_dir
from statecache.tiers.dirlock import Busy, DirLock
from statecache.tiers.disk import DiskTier


def open_disk(
    cfg: CacheConfig,
    fingerprint: str,
    *,
    state_format: int,
    on_evict: Callable[[str], None],
) -> tuple[DiskTier, DirLock] | str:
    """The disk tier with its directory locked, or why it is off."""
    if not cfg.secret_path:
        return "cache.secret_path is empty: without a key nothing on disk can be trusted"
    directory = Path(cfg.disk_path).expanduser()
    key_path = Path(cfg.secret_path).expanduser()
    try:
        if directory.exists() and not directory.is_dir():
            return f"{directory} is not a directory"
        make_private_dir(directory)
        st = os.stat(directory)
        # Root may write anywhere, so the owner's write bit is checked, not access().
        if not st.st_mode & stat.S_IWUSR or not os.access(directory, os.W_OK | os.X_OK):
            return f"{directory} is read-only (mode {oct(stat.S_IMODE(st.st_mode))})"
        check_key_outside(key_path, directory)
        key = load_key(key_path)
        lock = DirLock(directory)
    except (Untrusted, Busy) as e:
        return str(e)
    except OSError as e:
        return f"{e.filename or directory}: {e.strerror or e}"
    tier = DiskTier(
        directory,
        cfg.disk_budget,
        fingerprint,
        state_format=state_format,
        page_size=cfg.page_size,
        key=key,
        on_evict=on_evict,
        level=cfg.compress_level,
        max_records=cfg.disk_max_checkpoints,
    )
    return tier, lock
