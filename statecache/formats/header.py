"""The first check of every stored piece of the shared store and of every KV page: the
header's magic, its format version and the id of the key that signed it. A piece that
fails it is refused before its metadata is read (``Refused.reason``: a metric label).
"""

from __future__ import annotations

from statecache.formats.diskfmt import key_id


class Refused(Exception):
    """A stored piece that must never be used; ``reason`` says why (a metric label)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def check_header(refused: type[Refused], what: str, found: tuple[bytes, int, bytes],
                 want: tuple[bytes, int], key: bytes | None) -> None:
    """Raise ``refused`` unless ``found`` (magic, version, key id) is ``want`` (magic,
    version) signed with ``key``; without a key (a listing, never a state) the key id
    is not checked. ``what`` names the piece in the message."""
    magic, version, kid = found
    if magic != want[0]:
        raise refused("corrupt", "wrong magic")
    if version != want[1]:
        raise refused("version", f"{what} format version {version}, expected {want[1]}")
    if key is not None and kid != key_id(key):
        raise refused("foreign_key", f"{what} signed with another key")
