"""What ``statecache models`` read from each GGUF header, kept between runs: a large
vocabulary takes its header 20-60 ms to step over, so a hundred real models would take
seconds; a file whose device, inode, size and modification time are unchanged is not read
again. One JSON file (~/.cache/statecache/gguf-headers.json, 0600); anything wrong with
it is an empty cache, and only the keys the listing uses are kept.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from proxy.models.header import Header, Skipped, read_header
from proxy.models.places import home

log = logging.getLogger(__name__)

VERSION = 1
MAX_ENTRIES = 4096
_GENERAL = ("general.architecture", "general.name", "general.file_type",
            "tokenizer.chat_template", "split.count")


def default_path() -> Path:
    return home() / ".cache" / "statecache" / "gguf-headers.json"


def _stamp(st: os.stat_result) -> list[int]:
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]


def _kept(h: Header) -> dict[str, Any]:
    prefix = h.architecture + "."
    return {k: v for k, v in h.fields.items()
            if (k in _GENERAL or k.startswith(prefix)) and not isinstance(v, Skipped)}


class HeaderCache:
    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.entries: dict[str, dict[str, Any]] = {}
        self.changed = False
        if path is None:
            return
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if isinstance(data, dict) and data.get("version") == VERSION and \
                    isinstance(data.get("entries"), dict):
                self.entries = {k: v for k, v in data["entries"].items() if isinstance(v, dict)}
        except (OSError, ValueError):
            pass  # no cache, or one that is not ours: read every header

    def header(self, path: Path) -> Header:
        """The header of ``path``, from the cache where the file is unchanged; BadGGUF or
        OSError as ``read_header`` raises them."""
        st = path.stat()
        key = str(path.resolve())
        hit = self.entries.get(key)
        if hit is not None and hit.get("stamp") == _stamp(st) and \
                isinstance(hit.get("fields"), dict):
            return Header(int(hit.get("version", 3)), int(hit.get("n_tensors", 0)),
                          hit["fields"])
        h = read_header(path, skim=True)
        self.entries[key] = {"stamp": _stamp(st), "version": h.version,
                             "n_tensors": h.n_tensors, "fields": _kept(h)}
        self.changed = True
        return Header(h.version, h.n_tensors, _kept(h))

    def save(self) -> None:
        """Write the cache back (atomically) if a header was read; files gone are dropped."""
        if self.path is None or not self.changed:
            return
        keep = {k: v for k, v in self.entries.items() if os.path.exists(k)}
        keep = dict(list(keep.items())[-MAX_ENTRIES:])
        tmp = ""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".gguf-headers.", dir=self.path.parent)
            with os.fdopen(fd, "w", encoding="utf-8") as fh:  # 0600, as mkstemp makes it
                json.dump({"version": VERSION, "entries": keep}, fh)
            os.replace(tmp, self.path)
        except OSError as e:  # a read-only home: the next run reads the headers again
            log.debug("cannot write %s: %s", self.path, e)
            if tmp:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
