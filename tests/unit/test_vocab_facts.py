"""What a vocabulary can encode and how long its tokens are, from its token texts."""

from __future__ import annotations

from proxy.engine.binding.vocab import SPM_SPACE, other_facts, spm_facts

BYTES = [f"<0x{b:02X}>".encode() for b in range(256)]
CHARS = [c.encode() for c in ["a", "b", SPM_SPACE, "\n", "<", "|", ">", "é"]]
SPECIAL = [b"<|im_end|>", b"<unk>"]


def test_full_byte_fallback_encodes_anything() -> None:
    f = spm_facts(BYTES + CHARS + SPECIAL, [False] * (256 + len(CHARS)) + [True, True])
    assert f.byte_fallback and f.first_unencodable("\t→😀", parse_special=False) is None
    assert f.special_texts == ("<|im_end|>", "<unk>")
    assert f.max_token_bytes == len("<|im_end|>")


def test_without_byte_fallback_the_first_missing_character_is_found() -> None:
    texts = CHARS + SPECIAL
    f = spm_facts(texts, [t in SPECIAL for t in texts])
    assert not f.byte_fallback
    assert f.first_unencodable("ab ab\né", parse_special=False) is None  # ' ' is looked up as ▁
    assert f.first_unencodable("ab\tb", parse_special=False) == 2
    assert f.first_unencodable("a→", parse_special=True) == 1
    # characters inside a special text are never looked up when specials parse
    assert f.first_unencodable("<unk>a", parse_special=True) is None
    assert f.first_unencodable("<unk>a", parse_special=False) == 1  # no "u"
    assert f.first_unencodable("<unk>u", parse_special=True) == 5


def test_some_byte_tokens_or_single_byte_texts_cover_a_character() -> None:
    # '\t' has a byte token; 'x' is a one-byte text (llama.cpp's second fallback)
    texts = [b"a", b"<0x09>", b"x"]
    f = spm_facts(texts, [False] * 3)
    assert f.first_unencodable("a\tx", parse_special=False) is None
    assert f.first_unencodable("a\ty", parse_special=False) == 2
    # a multi-byte character needs every one of its bytes
    assert f.first_unencodable("é", parse_special=False) == 0


def test_other_vocabularies_never_refuse_and_bound_only_bpe() -> None:
    bpe = other_facts([b"ab", b"abcdef"], [False, False], bounded=True)
    assert bpe.first_unencodable("\t", parse_special=False) is None
    assert bpe.max_token_bytes == 6
    assert other_facts([b"ab"], [False], bounded=False).max_token_bytes is None
