"""Where a live lane can be cut back anywhere (plain attention; SWA with every cell kept,
``model.swa_full = true``),
a prefill does not stop at its checkpoints: its steps stay whole, as llama-server's
ubatches are, and the lane owes those checkpoints until it is cut back or replaced; then
each is taken from the live lane, deepest first (cut back to it, saved), and a request
that starts from one answers as the same request served cold.

Before this, each share point, breakpoint and replay point ended a step: a cold prompt
of 1,200 tokens took 6 steps where 512-token steps make 3.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from proxy.engine.engine import Engine
from proxy.engine.types import GenerationRequest, SamplingParams
from statecache.config import load_config
from statecache.records import Kind
from tests.model.runs import assert_as_cold, generate

STEP = 512


def _fulls(eng: Engine) -> set[int]:
    assert eng.pool is not None
    return {r["n"] for r in eng.pool.describe() if r["kind"] == Kind.FULL.value}


def _req(prompt: list[int], **kw: object) -> GenerationRequest:
    return GenerationRequest("t", tuple(prompt), SamplingParams(
        temperature=0.0, max_tokens=6, logprobs=4), **kw)  # type: ignore[arg-type]


def _check(path: Path, tmp_path: Path, near_tie: float,
           more: dict[str, object] | None = None) -> None:
    more = more or {}
    cfg = load_config(None, {"model.path": str(path), "engine.sanity_checks": True,
                             "model.n_ctx": 4096, "server.lanes": 1,
                             "cache.disk_enabled": False, "speculative.source": "off", **more})
    eng = Engine(cfg, path)
    cold = Engine(load_config(None, {**{"model.path": str(path)}, "model.n_ctx": 4096,
                                     "server.lanes": 1, "cache.enabled": False,
                                     "speculative.source": "off", **more}), path)
    try:
        assert eng.publisher.kind() is Kind.FULL  # a live lane is cut back by seq_rm
        words = eng.model.tokenize
        a = words(" ".join(f"rule {i}: every session of this agent shares it;"
                           for i in range(300)))[:1200]
        assert len(a) == 1200
        share, mark, history = 700, 900, 1100
        req = _req(a, share_points=(share,), breakpoints=((mark, 300.0),),
                   history_tokens=history)
        _, _, fin = generate(eng, req)
        # whole steps, nothing saved before the first token, the points owed
        assert fin.stats.prefill_steps == math.ceil(len(a) / STEP)
        assert fin.stats.checkpoints_added == 0 and not _fulls(eng)
        replay = history // eng.exec.page * eng.exec.page
        lane = eng.parts.lanes.lanes[0]
        assert [n for n, _, _ in lane.owed] == [share, mark, replay]
        # a new conversation parts from the first at the share point, in its lane: the
        # lane is handed off, its state kept, and what it owes above the cut taken
        b = a[:share] + words(" ".join(f"a new task {i} about other things"
                                       for i in range(30)))
        got, _, fin = generate(eng, _req(b))
        assert fin.stats.source == "lane" and fin.usage.cached_tokens == share
        assert {mark, replay} <= _fulls(eng)
        assert_as_cold(cold, _req(b), got, near_tie)
        # the first conversation comes back with its reply rendered anew: it restores the
        # owed replay point from RAM, and answers as it would cold
        c = a[:history] + words(" ".join(f"and turn {i} that follows" for i in range(12)))
        got, _, fin = generate(eng, _req(c))
        assert fin.stats.source == "ram" and fin.usage.cached_tokens == replay
        assert_as_cold(cold, _req(c), got, near_tie)
        # the breakpoint's checkpoint is kept for its ttl
        assert eng.pool is not None
        kept = [r for r in eng.pool.describe() if r["n"] == mark]
        assert kept and kept[0].get("kept_until"), kept
    finally:
        eng.close()
        cold.close()


def test_plain_attention_owes_its_checkpoints(draft_path: Path, tmp_path: Path) -> None:
    _check(draft_path, tmp_path, near_tie=0.05)


def test_sliding_window_owes_its_checkpoints(gemma_path: Path, tmp_path: Path) -> None:
    """Gemma 3 keeping every SWA cell, named rather than left to the default: with a
    window-sized SWA cache it publishes as a hybrid does (tests/http/test_swa_window.py)."""
    _check(gemma_path, tmp_path, near_tie=0.5, more={"model.swa_full": True})


def test_a_window_sized_swa_cache_owes_its_last_steps_points(gemma_path: Path,
                                                             tmp_path: Path) -> None:
    """Gemma 3 with a window-sized SWA cache (``model.swa_full = false``): the lane cannot
    be cut back anywhere, but it can be cut back less than a step (its cells reach a
    window back). A cold prompt's share point and a breakpoint before its last step are
    saved behind the steps that pass them, where they are (Publisher.save_behind), and
    the points inside its last step (a breakpoint, the history's end) are owed: the
    prefill takes llama-server's steps, no more. Before, each cut a step short (5
    steps); then the breakpoint went down onto the grid (512), giving up 48 tokens."""
    more: dict[str, object] = {"model.swa_full": False}
    path = gemma_path
    cfg = load_config(None, {"model.path": str(path), "engine.sanity_checks": True,
                             "model.n_ctx": 4096, "server.lanes": 1,
                             "cache.disk_enabled": False, "speculative.source": "off", **more})
    eng = Engine(cfg, path)
    cold = Engine(load_config(None, {"model.path": str(path), "model.n_ctx": 4096,
                                     "server.lanes": 1, "cache.enabled": False,
                                     "speculative.source": "off", **more}), path)
    try:
        assert eng.parts.memory.swa_window and eng.publisher.kind() is Kind.PARTIAL
        words = eng.model.tokenize
        a = words(" ".join(f"rule {i}: every session of this agent shares it;"
                           for i in range(300)))[:1200]
        share, mark, history = 700, 1100, 1190
        early = 560  # a breakpoint further back, inside the second step
        req = _req(a, share_points=(share,), breakpoints=((early, 300.0), (mark, 300.0)),
                   history_tokens=history)
        _, _, fin = generate(eng, req)
        assert fin.stats.prefill_steps == math.ceil(len(a) / STEP)
        # both saved behind the second step, where they are
        assert _fulls(eng) == {early, share}
        assert eng.meter.behind_checkpoints.get() == 2
        replay = history // eng.exec.page * eng.exec.page
        lane = eng.parts.lanes.lanes[0]
        assert [n for n, _, _ in lane.owed] == [mark, replay]
        # a new conversation parts from the first inside its last step, in its lane: cut
        # back live, after the lane paid what it owes above the cut
        part = 1060
        b = a[:part] + words(" ".join(f"a new task {i} about other things"
                                      for i in range(30)))
        got, _, fin = generate(eng, _req(b))
        assert fin.stats.source == "lane" and fin.usage.cached_tokens == part
        assert {mark, replay} <= _fulls(eng)
        assert_as_cold(cold, _req(b), got, 0.5)
        # the first conversation comes back with its reply rendered anew: the replay
        # point it owed, from RAM, answers as cold
        c = a[:history] + words(" ".join(f"and turn {i} that follows" for i in range(12)))
        got, _, fin = generate(eng, _req(c))
        assert fin.stats.source == "ram" and fin.usage.cached_tokens == replay
        assert_as_cold(cold, _req(c), got, 0.5)
        # a new conversation that parts at the early breakpoint: its state, made from
        # the saves around the step, answers as cold
        d = a[:early] + words(" ".join(f"another task {i}" for i in range(40)))
        got, _, fin = generate(eng, _req(d))
        assert fin.stats.source == "ram" and fin.usage.cached_tokens == early
        assert_as_cold(cold, _req(d), got, 0.5)
        assert eng.pool is not None
        for n in (mark, early):
            kept = [r for r in eng.pool.describe() if r["n"] == n]
            assert kept and kept[0].get("kept_until"), (n, kept)
    finally:
        eng.close()
        cold.close()


def test_a_follow_ups_prompt_end_is_saved_after_its_first_token(gemma_path: Path) -> None:
    """A window-sized SWA cache: a follow-up of less than a step cuts no step short and
    saves one checkpoint, the PARTIAL state at its prompt's end, and saves it once its
    first token is written to the client: the save is not in its TTFT (a lane's own
    partial state is for its next turn; nobody waits for it). Before, it was saved
    before the first token was sampled."""
    cfg = load_config(None, {"model.path": str(gemma_path), "engine.sanity_checks": True,
                             "model.n_ctx": 4096, "server.lanes": 1, "model.swa_full": False,
                             "cache.disk_enabled": False, "speculative.source": "off"})
    eng = Engine(cfg, gemma_path)
    saves: list[tuple[int, bool, Kind]] = []
    publish = eng.publisher.publish

    def spy(job: Any, role: Any, kind: Kind) -> None:
        saves.append((job.lane.n, job.out.written, kind))
        publish(job, role, kind)

    eng.publisher.publish = spy  # type: ignore[method-assign]
    try:
        words = eng.model.tokenize
        a = words(" ".join(f"rule {i}: every session of this agent shares it;"
                           for i in range(300)))[:700]
        generate(eng, _req(a, history_tokens=697))
        saves.clear()
        b = a + words(" ".join(f"and turn {i} that follows" for i in range(12)))
        _, _, fin = generate(eng, _req(b, history_tokens=len(b) - 3))
        assert fin.usage.cached_tokens == len(a) and fin.stats.prefill_steps == 1
        assert fin.stats.publish_s < 1e-3  # nothing saved before the first token (a save: ms)
        # (then the reply's end, at len(b) + 5)
        assert [s for s in saves if s[0] <= len(b)] == [(len(b), True, Kind.PARTIAL)]
    finally:
        eng.close()
