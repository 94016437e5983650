"""The GGUF header reader against the ``gguf`` package's own reader, and on files that are
not what they claim: each is a BadGGUF naming the file and the byte, never a read past
the end or a traceback of another kind."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import pytest

from proxy.models.header import BadGGUF, Skipped, read_header


@pytest.mark.parametrize("which", ["hybrid_path", "norollback_path", "draft_path"])
def test_every_value_is_the_gguf_packages(which: str, request: pytest.FixtureRequest) -> None:
    path: Path = request.getfixturevalue(which)
    ours = read_header(path)
    theirs = gguf.GGUFReader(path)
    names = [n for n in theirs.fields if not n.startswith("GGUF.")]
    assert list(ours.fields) == names
    assert ours.n_tensors == len(theirs.tensors) and ours.version == 3
    for name in names:
        want = theirs.fields[name].contents()
        got = ours.fields[name]
        if isinstance(got, Skipped):  # a long array: only its length
            assert got.length == len(want), name
        elif isinstance(got, float):
            assert got == pytest.approx(want, rel=1e-7), name
        else:
            assert got == want, name
    assert isinstance(ours.fields["tokenizer.ggml.tokens"], Skipped)  # stepped over, not read
    assert ours.chat_template == theirs.fields["tokenizer.chat_template"].contents()


def _cut(src: Path, dst: Path, n: int) -> Path:
    dst.write_bytes(src.read_bytes()[:n])
    return dst


def test_a_truncated_file_says_where(hybrid_path: Path, tmp_path: Path) -> None:
    full = read_header(hybrid_path)
    assert full.chat_template
    data = hybrid_path.read_bytes()
    # inside the counts, inside a key, inside the vocabulary, inside the template
    vocab_at = data.index(b"tokenizer.ggml.tokens") + 40
    template_at = data.index(b"tokenizer.chat_template") + 100
    for n in (30, 60, vocab_at, template_at):
        with pytest.raises(BadGGUF, match=r"truncated: .* \(at byte [\d,]+ of [\d,]+\)"):
            read_header(_cut(hybrid_path, tmp_path / f"cut{n}.gguf", n))


@pytest.mark.parametrize(("data", "why"), [
    (b"", "too short"),
    (b"PK\x03\x04" + bytes(40), "not a GGUF file"),
    (b"GGUF" + struct.pack("<IQQ", 1, 0, 0), "version 1"),
    (b"GGUF" + struct.pack("<IQQ", 3, 0, 1 << 40), "metadata pairs"),
    # a key whose length claims more bytes than the file has
    (b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, 1 << 62), "a string of"),
    (b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, 3) + b"abc" + struct.pack("<I", 99), "value type 99"),
    # an array of 2^60 strings: stepped over until the bytes run out, not allocated
    (b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, 1) + b"k" + struct.pack("<IIQ", 9, 8, 1 << 60),
     "truncated"),
    (b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, 1) + b"k" + struct.pack("<IQ", 8, 2) + b"\xff\xfe",
     "not UTF-8"),
])
def test_not_a_model_header(tmp_path: Path, data: bytes, why: str) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    with pytest.raises(BadGGUF, match=why) as e:
        read_header(path)
    assert str(path) in str(e.value)


def test_skimming_finds_what_the_listing_needs(hybrid_path: Path, tmp_path: Path) -> None:
    from tests.model_layouts import header_gguf

    full, skim = read_header(hybrid_path), read_header(hybrid_path, skim=True)
    assert skim.chat_template == full.chat_template
    assert "tokenizer.ggml.tokens" not in skim.fields  # the vocabulary was never walked
    assert {k: v for k, v in full.fields.items() if k.startswith("qwen35.")} == \
        {k: v for k, v in skim.fields.items() if k.startswith("qwen35.")}
    # no template near the vocabulary: read in full, to the last key
    bare = header_gguf(tmp_path / "bare.gguf", "llama", {"block_count": 2}, vocab=500)
    assert read_header(bare, skim=True).fields == read_header(bare).fields
