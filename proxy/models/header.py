"""A GGUF file's header: its key-value metadata, read without loading the model.

The format (GGUF versions 2 and 3, little-endian): the magic ``GGUF``, a u32 version, u64
counts of tensors and of key-value pairs, then each pair as a string key, a u32 value
type and the value; a string is a u64 length and UTF-8 bytes. Only the metadata is read:
the tensor infos and the weights after it are never touched.

Not ``gguf.GGUFReader``: it builds a numpy view for every element of every array, and a
vocabulary is an array of up to 262,144 strings (2.7 s for SmolLM2's header, 12.9 s for
Gemma 3's). Here a large array is stepped over and kept only as its type and length, so
Gemma 3's header reads in about 50 ms. The tests check every value against GGUFReader's.

``skim=True`` (``statecache models``) does not step over the vocabulary: once the model's
shape is read (converters write it before the tokenizer), the chat template is found by
its key, framed as the format frames it (length, name, string type), with one search of
the next 16 MiB (a vocabulary and its merges: 1 ms for SmolLM2's, 7 for a 151k one). A
vocabulary string holding those 35 exact bytes would fool it, so only the listing skims;
a header whose shape follows its vocabulary, or whose template is not in that window
(Gemma 3 270M has none), is read in full.

Bad input is a ``BadGGUF`` (a ValueError) naming the file and the byte where it went
wrong, never a read past the end: every length is checked against the file's size.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAGIC = b"GGUF"
VERSIONS = (2, 3)
STRING, ARRAY = 8, 9
# value type -> struct format of one element (GGUF's GGUFValueType numbering)
_SCALARS: dict[int, str] = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?",
                            10: "Q", 11: "q", 12: "d"}
KEEP_ARRAY = 4096  # numeric arrays up to this long are kept (per-layer values)
KEEP_STRINGS = 64  # string arrays up to this long are kept (tags, languages)
MAX_KV = 1 << 16  # more pairs than this is no model header
MAX_TEMPLATE = 1 << 20  # a chat template longer than 1 MiB is refused
SKIM_WINDOW = 16 << 20  # bytes searched for the chat template when skimming


class BadGGUF(ValueError):
    """The file is not a GGUF this reader can use; the message says why and where."""


@dataclass(slots=True, frozen=True)
class Skipped:
    """An array left unread: its element type and length (a vocabulary, merges, scores)."""

    type: int
    length: int


@dataclass(slots=True, frozen=True)
class Header:
    version: int
    n_tensors: int
    fields: Mapping[str, Any]  # scalars, short arrays as lists, long ones as Skipped

    @property
    def architecture(self) -> str:
        arch = self.fields.get("general.architecture")
        return arch if isinstance(arch, str) else ""

    def arch_value(self, key: str, default: Any = None) -> Any:
        """``{architecture}.{key}``: the keys of a model's shape are named by its arch."""
        return self.fields.get(f"{self.architecture}.{key}", default)

    @property
    def chat_template(self) -> str:
        t = self.fields.get("tokenizer.chat_template")
        return t if isinstance(t, str) else ""


def read_header(path: str | Path, *, skim: bool = False) -> Header:
    """The metadata of the GGUF at ``path`` (OSError when it cannot be opened); ``skim``:
    the shape and the chat template only, the vocabulary not walked (module doc)."""
    path = Path(path)
    with path.open("rb") as fh:
        size = fh.seek(0, 2)
        if size < 24:
            raise BadGGUF(f"{path}: {size} bytes, too short for a GGUF header")
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            return _Reader(mm, size, str(path), skim).header()


TEMPLATE_KEY = "tokenizer.chat_template"
_TEMPLATE_FRAME = struct.pack("<Q", len(TEMPLATE_KEY)) + TEMPLATE_KEY.encode() + \
    struct.pack("<I", STRING)


class _Skimmed(Exception):
    """The shape is read and a vocabulary begins: the rest is the template's search."""


class _Reader:
    def __init__(self, buf: mmap.mmap, size: int, name: str, skim: bool = False) -> None:
        self.buf, self.size, self.name, self.off = buf, size, name, 0
        self.skim = skim
        self.fields: dict[str, Any] = {}

    def fail(self, why: str) -> BadGGUF:
        return BadGGUF(f"{self.name}: {why} (at byte {self.off:,} of {self.size:,})")

    def need(self, n: int) -> None:
        if n < 0 or self.off + n > self.size:
            raise self.fail("truncated: the header runs past the end of the file")

    def unpack(self, fmt: str) -> Any:
        s = _STRUCTS[fmt]
        self.need(s.size)
        value = s.unpack_from(self.buf, self.off)[0]
        self.off += s.size
        return value

    def string(self, limit: int | None = None) -> str:
        n = self.unpack("Q")
        if limit is not None and n > limit:
            raise self.fail(f"a string of {n:,} bytes")
        self.need(n)
        raw = self.buf[self.off:self.off + n]
        self.off += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail("a string that is not UTF-8") from None

    def skip_strings(self, n: int) -> None:
        # the hot loop of a vocabulary: local names, no per-string decode
        q, buf, off, size = _STRUCTS["Q"].unpack_from, self.buf, self.off, self.size
        for _ in range(n):
            if off + 8 > size:
                self.off = off
                raise self.fail("truncated: the header runs past the end of the file")
            off += 8 + q(buf, off)[0]
        if off > size:
            raise self.fail("truncated: the header runs past the end of the file")
        self.off = off

    def value(self, vtype: int, key: str) -> Any:
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == STRING:
            return self.string(MAX_TEMPLATE if key == TEMPLATE_KEY else None)
        if vtype != ARRAY:
            raise self.fail(f"unknown value type {vtype} for {key}")
        etype, n = self.unpack("I"), self.unpack("Q")
        if etype in _SCALARS:
            width = _STRUCTS[_SCALARS[etype]].size
            self.need(n * width)
            if n > KEEP_ARRAY:
                self.off += n * width
                return Skipped(etype, n)
            values = list(struct.unpack_from(f"<{n}{_SCALARS[etype]}", self.buf, self.off))
            self.off += n * width
            return values
        if etype == STRING:
            if n > KEEP_STRINGS:
                if self.skim and self.shape_read():
                    raise _Skimmed
                self.skip_strings(n)
                return Skipped(etype, n)
            return [self.string() for _ in range(n)]
        raise self.fail(f"an array of type {etype} in {key}")

    def header(self) -> Header:
        if self.buf[:4] != MAGIC:
            raise self.fail("not a GGUF file (no GGUF magic)")
        self.off = 4
        version = self.unpack("I")
        if version not in VERSIONS:
            raise self.fail(f"GGUF version {version}; this reader knows 2 and 3")
        n_tensors, n_kv = self.unpack("Q"), self.unpack("Q")
        if n_kv > MAX_KV:
            raise self.fail(f"{n_kv:,} metadata pairs")
        fields = self.fields
        for _ in range(n_kv):
            key = self.string(limit=1 << 16)
            at = self.off
            try:
                fields[key] = self.value(self.unpack("I"), key)
            except _Skimmed:
                if self.find_template():
                    break
                self.skim, self.off = False, at  # no template near: read on in full
                fields[key] = self.value(self.unpack("I"), key)
        return Header(version, n_tensors, fields)

    def shape_read(self) -> bool:
        arch = self.fields.get("general.architecture")
        return isinstance(arch, str) and f"{arch}.block_count" in self.fields

    def find_template(self) -> bool:
        at = self.buf.find(_TEMPLATE_FRAME, self.off, self.off + SKIM_WINDOW)
        if at < 0:
            return False
        self.off = at + len(_TEMPLATE_FRAME)
        self.fields[TEMPLATE_KEY] = self.string(MAX_TEMPLATE)
        return True


_STRUCTS: dict[str, struct.Struct] = {f: struct.Struct("<" + f) for f in
                                      set(_SCALARS.values()) | {"I", "Q"}}
