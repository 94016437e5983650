"""Re-tokenization: a reply sent back as text may tokenize to other ids than the model
generated, so the end-of-reply state cannot match; ``cache.splice_generated`` fixes it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.http.agent import Session, tool_result
from tests.http.conftest import DoneLines, serve

pytestmark = pytest.mark.http
PAGE = 32


async def _second_turn_cached(model: Path, ckpt: Path, splice: bool) -> tuple[int, int]:
    async with serve(model, ckpt, cache__splice_generated=splice, cache__disk_enabled=False,
                     server__lanes=1) as srv:
        s = Session(srv.client)
        t1 = await s.turn()
        t2 = await s.turn(tool_result(1))
    return t2.cached_tokens, t1.prompt_tokens + t1.completion_tokens


async def test_gemma_reply_retokenizes_differently_and_splicing_recovers_it(
    gemma_path: Path, tmp_path: Path, done_lines: DoneLines
) -> None:
    # Gemma 3 answers this session with code; re-tokenizing its reply text merges
    # whitespace into other ids, so without splicing the follow-up reuses less than the
    # previous prompt and reply (the live SWA lane is cut back to the first difference).
    plain, before = await _second_turn_cached(gemma_path, tmp_path / "a", splice=False)
    assert plain < before - PAGE, (plain, before)
    spliced, before2 = await _second_turn_cached(gemma_path, tmp_path / "b", splice=True)
    assert before2 == before
    assert spliced >= before - 1, (spliced, before)


async def test_single_character_vocabulary_needs_no_splicing(
    hybrid_path: Path, tmp_path: Path
) -> None:
    # DESIGN.md fact 3: every generated text re-tokenizes to the same ids.
    cached, before = await _second_turn_cached(hybrid_path, tmp_path / "a", splice=False)
    assert cached >= before - 1
