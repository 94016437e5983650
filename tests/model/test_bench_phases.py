"""What the benchmark reads about a follow-up's TTFT: the engine's per-phase debug line
(parsed by ``bench.harness.statecache_log_lines`` from the real engine's log, so a
change of either side fails here) and ``bench.ideal``'s prefill of new tokens at the
context length where they land."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import bench.ideal
from bench.harness import PHASES, statecache_log_lines
from bench.ideal import measure
from proxy.engine.binding import Context
from proxy.engine.engine import Engine
from proxy.engine.types import GenerationRequest, SamplingParams, TokenEvent
from statecache.config import load_config
from tests.busy import THREADS


def _run(eng: Engine, prompt: tuple[int, ...], n: int) -> list[int]:
    async def go() -> list[int]:
        out: list[int] = []
        async for ev in eng.generate(GenerationRequest(
                "t", prompt, SamplingParams(temperature=0.0, max_tokens=n))):
            if isinstance(ev, TokenEvent):
                out += ev.token_ids
        return out
    return asyncio.run(go())


def test_every_done_line_carries_its_phases_and_they_add_up(
    hybrid_path: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = load_config(None, {"model.path": str(hybrid_path), "model.threads": THREADS,
                             "engine.sanity_checks": True, "model.n_ctx": 2048,
                             "server.lanes": 1, "cache.disk_path": str(tmp_path / "ck")})
    eng = Engine(cfg, hybrid_path)
    caplog.set_level(logging.DEBUG, logger="statecache")
    try:
        first = tuple(eng.model.tokenize("a first question about state " * 20))
        reply = _run(eng, first, 8)
        follow = first + tuple(reply) + tuple(eng.model.tokenize(" and a follow-up " * 10))
        _run(eng, follow, 8)
    finally:
        eng.close()
    log = "\n".join(f"12:00:00 INFO statecache: {m}" for m in caplog.messages)
    lines = statecache_log_lines(log)
    assert [ln["input"] for ln in lines] == [len(first), len(follow)]
    for ln in lines:
        ph = ln["phases"]
        assert ph is not None and set(ph) == set(PHASES)
        assert ph["restore"] <= ph["plan"] + 0.1 and ph["hand-off"] <= ph["plan"] + 0.1
        assert ph["checkpoints"] <= ph["prefill"] + 0.1
        assert ph["prefill"] <= ph["engine TTFT"] + 0.1
        assert ph["prefill steps"] >= 1
    assert lines[1]["cached"] > 0  # the follow-up reused the first turn: a real follow-up
    # the lines without a phases line before them (log at info) carry None, not a neighbour's
    info_only = "\n".join(m for m in log.splitlines() if " phases " not in m)
    assert [ln["phases"] for ln in statecache_log_lines(info_only)] == [None, None]


def test_ideal_prefill_grows_with_new_tokens_and_refuses_shrinking_sessions(
    hybrid_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # bench.ideal's clock charges a microsecond for each token the binding has prefilled
    # (the real prefill runs): what it times is then the new tokens of each pair, not
    # the base it prefills untimed, whatever a busy machine makes of 8 against 400
    prefilled = [0]
    prefill = Context.prefill

    def counting(self: Context, lane: int, tokens: Any, *args: Any, **kw: Any) -> Any:
        prefilled[0] += len(tokens)
        return prefill(self, lane, tokens, *args, **kw)

    monkeypatch.setattr(Context, "prefill", counting)
    monkeypatch.setattr(bench.ideal, "time", SimpleNamespace(
        perf_counter=lambda: prefilled[0] * 1e-6))
    (times,) = measure(str(hybrid_path), [[(200, 8), (260, 400)]], n_ctx=2048, repeats=1)
    assert times == pytest.approx([8e-6, 400e-6]), times
    with pytest.raises(ValueError):
        measure(str(hybrid_path), [[(300, 10), (100, 10)]], n_ctx=2048, repeats=1)


def test_chunk_costs_are_measured_alone_and_beside_a_decoding_lane(hybrid_path: Path) -> None:
    from bench.chunks import measure as chunks

    res = chunks(hybrid_path, 200, (1, 64, 65), 2)
    assert res["context"] == 200 and float(res["decode_ms"]) > 0  # type: ignore[arg-type]
    rows = res["rows"]
    assert [r["tokens"] for r in rows] == [1, 64, 65]  # type: ignore[attr-defined]
    for r in rows:  # type: ignore[attr-defined]
        assert r["alone_ms"] > 0 and r["beside_decode_ms"] > 0


def test_the_binding_floor_decodes_several_lanes_in_one_batch(hybrid_path: Path) -> None:
    from bench.batching import DirectDecoder

    d = DirectDecoder(hybrid_path, lanes=4)
    try:
        for streams in (1, 4):
            assert d.rate(8, streams) > 0
            # every lane it used holds its prompt and the 8 tokens decoded after it
            for lane in range(streams):
                assert d.ctx.pos_max(lane) == len(d.prompts[lane]) + 8 - 1
            if streams == 1:
                assert d.ctx.pos_max(1) == -1  # the other lanes stay empty
    finally:
        d.close()
