"""Who may have written what the disk tier reads: directory checks and the secret key.

Like OpenSSH's StrictModes: a checkpoint directory (and each directory above it) must
be owned by this user (or root) and writable by no one else, unless it is sticky like
/tmp; otherwise another user could plant files in it. The key that authenticates
checkpoint files lives outside that directory, 0600, created on first use.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

from statecache.formats.diskfmt import KEY_BYTES


class Untrusted(Exception):
    """A path the disk tier must not use; the message says why and what to do."""


def _mode(st: os.stat_result) -> str:
    return oct(stat.S_IMODE(st.st_mode))


def _check_ancestors(path: Path) -> None:
    uid = os.getuid()
    for parent in path.parents:
        st = os.stat(parent)
        if st.st_uid not in (uid, 0):
            raise Untrusted(f"{parent} is owned by uid {st.st_uid}, neither you nor root")
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise Untrusted(
                f"{parent} is writable by group or others (mode {_mode(st)}): "
                "another user could replace what is below it"
            )


def check_dir(path: Path) -> None:
    """Raise Untrusted unless ``path`` is a directory only this user can change."""
    real = path.resolve()
    st = os.stat(real)
    if not stat.S_ISDIR(st.st_mode):
        raise Untrusted(f"{path} is not a directory")
    if st.st_uid != os.getuid():
        raise Untrusted(f"{path} is owned by uid {st.st_uid}, not by you (uid {os.getuid()})")
    if st.st_mode & 0o022:
        raise Untrusted(
            f"{path} is writable by group or others (mode {_mode(st)}); "
            f"run `chmod go-w {path}`"
        )
    _check_ancestors(real)


def make_private_dir(path: Path) -> None:
    """Create ``path`` and any missing parents with mode 0700 (mkdir's own parents
    would follow the umask, perhaps group-writable), then check it."""
    missing: list[Path] = []
    p = path
    while not p.exists() and not p.is_symlink():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        # One made by another process just now is checked below like any other.
        with contextlib.suppress(FileExistsError):
            d.mkdir(mode=0o700)
    check_dir(path)


def load_key(path: Path, *, create: bool = True) -> bytes:
    """The secret key at ``path``: 32 random bytes, created (0600, atomically) if absent.

    Raises Untrusted for a key another user could read or replace, OSError when it
    cannot be read or made.
    """
    if create:
        make_private_dir(path.parent)
    else:
        check_dir(path.parent)
    try:
        return _read_key(path)
    except FileNotFoundError:
        if not create:
            raise
    _create_key(path)
    return _read_key(path)


def _read_key(path: Path) -> bytes:
    flags = os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno in (getattr(os, "ELOOP", -1), 40):
            raise Untrusted(f"key file {path} is a symlink") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Untrusted(f"key file {path} is not a regular file")
        if st.st_uid != os.getuid():
            raise Untrusted(f"key file {path} is owned by uid {st.st_uid}, not by you")
        if st.st_mode & 0o077:
            raise Untrusted(
                f"key file {path} is readable or writable by others (mode {_mode(st)}); "
                f"run `chmod 600 {path}`"
            )
        key = os.read(fd, KEY_BYTES + 1)
    finally:
        os.close(fd)
    if len(key) != KEY_BYTES:
        raise Untrusted(f"key file {path} holds {len(key)} bytes, not {KEY_BYTES}")
    return key


def _create_key(path: Path) -> None:
    # Written whole under a temporary name, then linked into place: a second process
    # racing this one either links first or reads the complete key of the first.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(tmp, flags, 0o600)
    try:
        os.write(fd, os.urandom(KEY_BYTES))
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    except OSError:  # a file system without hard links: create in place, exclusively
        try:
            fd = os.open(path, flags, 0o600)
        except FileExistsError:
            return
        try:
            os.write(fd, tmp.read_bytes())
            os.fsync(fd)
        finally:
            os.close(fd)
    finally:
        tmp.unlink(missing_ok=True)


def check_key_outside(key_path: Path, directory: Path) -> None:
    """A key inside the checkpoint directory would be as writable as the files it signs."""
    key_real, dir_real = key_path.resolve(), directory.resolve()
    if key_real == dir_real or dir_real in key_real.parents:
        raise Untrusted(
            f"the key file {key_path} is inside the checkpoint directory {directory}; "
            "set cache.secret_path elsewhere"
        )
