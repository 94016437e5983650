"""Where a request's time to its first token went, as the server says it: the ``Done``
line and ``GET /admin/requests`` give the time outside ``llama_decode`` and the phases
(the HTTP side's render and tokenize, queue, plan, prefill, the time inside llama_decode,
checkpoints), counted from the moment the handler began."""

from __future__ import annotations

import re
from pathlib import Path

import aiohttp
import pytest

from tests.http.conftest import DoneLines, serve

OUTSIDE = re.compile(r"TTFT ([\d.]+) s .* outside llama_decode ([\d.]+) ms \(([\d.]+)%\)")


async def test_the_time_outside_llama_decode_is_the_ttft_less_the_decodes(
        hybrid_path: Path, tmp_path: Path, done_lines: DoneLines) -> None:
    messages = [{"role": "system", "content": "You answer briefly. " * 40},
                {"role": "user", "content": "Name three rivers."}]
    async with serve(hybrid_path, tmp_path / "ckpt") as srv:
        for _ in range(2):  # cold, then the same prompt again: nothing to decode for it
            await srv.client.chat.completions.create(model="m", messages=messages,
                                                     max_tokens=4, temperature=0)
        async with aiohttp.ClientSession() as http, \
                http.get(srv.url + "/admin/requests") as r:
            cold, again = (await r.json())["requests"]
    for rec in (cold, again):
        ph = rec["phases_ms"]
        assert ph["render"] > 0 and ph["tokenize"] > 0
        assert ph["http"] >= ph["render"] + ph["tokenize"] - 0.02
        # the TTFT counts the HTTP side too, and what is not llama_decode is outside it
        assert 1000 * rec["ttft_s"] >= ph["http"] + ph["queue"] - 0.1
        assert rec["outside_ms"] == pytest.approx(1000 * rec["ttft_s"] - ph["llama_decode"],
                                                  abs=0.2)
    assert cold["phases_ms"]["llama_decode"] > 0 and cold["phases_ms"]["prefill_steps"] >= 1
    # step by step: one row a prefill step, which together make its prefill and its
    # time inside llama_decode
    steps = cold["steps_ms"]
    assert len(steps) == cold["phases_ms"]["prefill_steps"]
    start = cold["prompt_tokens"] - cold["prefilled"]
    assert [p for p, _, _ in steps] == [start + sum(n for _, n, _ in steps[:i])
                                        for i in range(len(steps))]
    assert sum(n for _, n, _ in steps) == cold["prefilled"]
    assert sum(ms for _, _, ms in steps) == pytest.approx(cold["phases_ms"]["llama_decode"],
                                                          abs=0.01 * len(steps))
    assert again["steps_ms"] == []
    # the repeat starts from the state at the prompt's end, with its logits: no decode
    assert again["prefilled"] == 0 and again["phases_ms"]["llama_decode"] == 0
    assert again["outside_ms"] == pytest.approx(1000 * again["ttft_s"], abs=0.2)
    done = [OUTSIDE.search(e) for e in done_lines.events if e.startswith("Done")]
    assert len(done) == 2 and all(done), done_lines.events
    for m, rec in zip(done, (cold, again), strict=True):
        assert m is not None
        assert float(m[2]) == pytest.approx(rec["outside_ms"], abs=0.1)
        # the record rounds the TTFT to 0.1 ms and outside_ms to 0.01 ms, the Done line
        # the share to 0.1%: within those roundings (a repeat's TTFT is a fraction of a
        # millisecond, which the record's 0.1 ms moves by a sixth)
        ttft_ms = 1000 * rec["ttft_s"]
        assert float(m[3]) == pytest.approx(100 * rec["outside_ms"] / ttft_ms,
                                            abs=100 * 0.055 / ttft_ms + 0.05)
