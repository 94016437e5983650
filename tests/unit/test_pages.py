from __future__ import annotations

import numpy as np
import pytest

from statecache.pages import PageChain, as_tokens, hash_page, namespace_hash


def test_namespace_is_length_prefixed() -> None:
    # A naive "fp:tenant" join would make these two namespaces collide.
    assert namespace_hash("a:b", "") != namespace_hash("a", "b:")
    assert namespace_hash("a", "b") != namespace_hash("ab", "")
    assert namespace_hash("m", "t") == namespace_hash("m", "t")
    assert len(namespace_hash("m", "")) == 16


def test_hash_page_depends_on_parent_and_tokens() -> None:
    h0 = namespace_hash("m", "")
    h1 = hash_page(h0, [1, 2, 3, 4])
    assert h1 == hash_page(h0, np.array([1, 2, 3, 4], dtype=np.int64))
    assert h1 != hash_page(h0, [1, 2, 3, 5])
    assert h1 != hash_page(namespace_hash("m", "x"), [1, 2, 3, 4])
    # Little-endian int32 bytes: 256 must not hash like [0, 1] packed another way.
    assert hash_page(h0, [256]) != hash_page(h0, [1])


def test_chain_hashes_whole_pages_only() -> None:
    ns = namespace_hash("m", "")
    chain = PageChain(ns, 4, list(range(10)))
    assert chain.n_pages == 2 and len(chain) == 10
    assert chain.hashes[0] == hash_page(ns, [0, 1, 2, 3])
    assert chain.hashes[1] == hash_page(chain.hashes[0], [4, 5, 6, 7])
    assert chain.hash_at(0) == ns


def test_incremental_hashing_equals_full_hashing() -> None:
    ns = namespace_hash("m", "t")
    tokens = list(range(100, 150))
    grown = PageChain(ns, 4)
    for piece in (tokens[:3], tokens[3:9], tokens[9:9], tokens[9:50]):
        grown.extend(piece)
    full = PageChain(ns, 4, tokens)
    assert grown.hashes == full.hashes
    # A longer request that starts with the old one reuses its pages.
    longer = full.for_tokens(tokens + [7, 8, 9, 10, 11])
    assert longer.hashes == PageChain(ns, 4, tokens + [7, 8, 9, 10, 11]).hashes
    assert longer.hashes[: full.n_pages] == full.hashes
    # A divergent one keeps only the shared whole pages and rehashes the rest.
    branch = tokens[:10] + [1, 2, 3, 4, 5, 6]
    assert full.for_tokens(branch).hashes == PageChain(ns, 4, branch).hashes
    assert full.for_tokens(np.array(branch)).hashes == PageChain(ns, 4, branch).hashes


def test_chain_tokens_are_a_copy_and_read_only() -> None:
    src = np.arange(8, dtype=np.int32)
    chain = PageChain(namespace_hash("m", ""), 4, src)
    src[0] = 99
    assert int(chain.tokens[0]) == 0
    with pytest.raises(ValueError):
        chain.tokens[0] = 5


@pytest.mark.parametrize("bad", [[-1], [2**31], [[1, 2]], ["a"], np.zeros((2, 2), dtype=int)])
def test_bad_tokens_are_rejected(bad: object) -> None:
    with pytest.raises(ValueError):
        as_tokens(bad)  # type: ignore[arg-type]
