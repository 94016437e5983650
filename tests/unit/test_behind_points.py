"""Points saved behind a step (a window-sized SWA cache whose window is at least a step,
``PointPicker._behind``): Claude Code's cold turn keeps its breakpoint and share point
where they are and prefills in llama-server's 39 whole steps."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from proxy.engine.layout import step_ends
from proxy.engine.points import PointPicker
from statecache.records import Kind, Role


def _behind(points: list[tuple[int, Role, Kind]], *, reuse: int, end: int,
            chunk: int = 512, shared: tuple[int, ...] = ()) -> tuple[list[int], list[int]]:
    picker = PointPicker(SimpleNamespace(chunk=chunk), lambda: Kind.PARTIAL)  # type: ignore[arg-type]
    job = SimpleNamespace(reuse=reuse, prompt=np.zeros(end, dtype=np.int32), behind=[])
    out = list(points)
    picker._behind(job, out, list(shared))  # type: ignore[arg-type]
    return [n for n, _, _ in out], [n for n, _, _ in job.behind]


def test_claude_codes_cold_turn_cuts_no_step() -> None:
    full, part = Kind.FULL, Kind.PARTIAL
    points = [(1024, Role.PERIODIC, full), (1485, Role.BRANCH, full),
              (18192, Role.BRANCH, full), (19600, Role.BRANCH, full),
              (19658, Role.REPLAY, part), (19659, Role.REPLAY, part)]
    cuts, behind = _behind(points, reuse=0, end=19659)
    # off the grid before the last step (19,456 on): saved behind the steps
    assert behind == [1485, 18192]
    # on the grid (a step ends there anyway), inside the last step (owed) or its end
    assert cuts == [1024, 19600, 19658, 19659]
    # a share point inside the last step: saved behind it too (for other lanes)
    cuts, behind = _behind(points, reuse=0, end=19659, shared=(18192, 19600))
    assert behind == [1485, 18192, 19600] and cuts == [1024, 19658, 19659]
    assert len(step_ends(cuts[:1], reuse=0, end=19659, chunk=512)) == 39


def test_the_grid_starts_where_the_prefill_does() -> None:
    points = [(1536, Role.BRANCH, Kind.FULL), (1700, Role.BRANCH, Kind.FULL),
              (2100, Role.BRANCH, Kind.FULL)]
    # from 1,200 the steps end at 1,712, 2,224...: 1,700 is in the first (behind)
    cuts, behind = _behind(points, reuse=1200, end=3000)
    assert behind == [1536, 1700, 2100] and cuts == []
    cuts, behind = _behind([(1712, Role.BRANCH, Kind.FULL)], reuse=1200, end=3000)
    assert cuts == [1712] and behind == []
