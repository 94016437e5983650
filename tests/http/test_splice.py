"""Re-tokenization and ``cache.splice_generated``.

On the test models a reply sent back as text tokenizes to the ids the model
generated (the synthetic vocabulary is single characters, docs/design.md fact 3; Gemma 3's
greedy replies round-trip too: ``python -m tools.retokenize_report``), so the
end-of-reply state matches without help. Splicing, off by default, must then change
nothing but where the prompt's ids come from.
"""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest

from tests.http.agent import Session, tool_result
from tests.http.conftest import serve

pytestmark = pytest.mark.http


async def _session(model: Path, ckpt: Path, splice: bool) -> tuple[Session, str]:
    async with serve(model, ckpt, cache__splice_generated=splice, server__lanes=1) as srv:
        s = Session(srv.client)
        await s.turn()
        await s.turn(tool_result(1))
        await s.turn(tool_result(2))
        async with aiohttp.ClientSession() as http, http.get(srv.url + "/metrics") as r:
            metrics = await r.text()
    return s, metrics


async def test_replies_round_trip_and_splicing_changes_nothing_else(
    hybrid_path: Path, tmp_path: Path
) -> None:
    plain, m_plain = await _session(hybrid_path, tmp_path / "a", splice=False)
    spliced, m_spliced = await _session(hybrid_path, tmp_path / "b", splice=True)
    for k in (1, 2):
        prev = plain.turns[k - 1]
        # the whole previous prompt and reply are reused (the last sampled token aside)
        assert plain.turns[k].cached_tokens == prev.prompt_tokens + prev.completion_tokens - 1
    assert [t.text for t in spliced.turns] == [t.text for t in plain.turns]
    assert [t.prompt_tokens for t in spliced.turns] == [t.prompt_tokens for t in plain.turns]
    assert [t.cached_tokens for t in spliced.turns] == [t.cached_tokens for t in plain.turns]
    assert "replies_spliced" not in m_plain
    assert "statecache_replies_spliced" in m_spliced.replace("_total", "")
