"""canitoolcall's conformance suite (469 recorded outputs, 9 families) through our
parsers, every chunking strategy (tools/toolcall_conformance.py says how fixtures map to
templates and how replies are cut into units).

A fixture passes when canitoolcall's checks give pass or soft pass (whitespace at the
ends); an ``expected_error`` fixture passes when we answer in one of the graceful ways
its spec accepts. ``KNOWN`` lists the fixtures that still fail, each to be fixed (the
test fails when one of them starts passing, so the list only shrinks); Kimi K3's
template renders a syntax we do not read yet: its fixtures are reported unsupported.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from canitoolcall.fixtures import Fixture
from canitoolcall.results import Status
from canitoolcall.runner import family_for

from tools.toolcall_conformance import StatecacheAdapter

KNOWN = frozenset(Path(__file__).with_name("canitoolcall_known.txt").read_text().split())
ADAPTER = StatecacheAdapter()


def test_conformance(canitoolcall_fixture: Fixture) -> None:
    case = ADAPTER.replay(canitoolcall_fixture, family_for(canitoolcall_fixture))
    if case.status is Status.UNSUPPORTED:
        assert canitoolcall_fixture.reference_model.startswith("moonshotai/Kimi-K3")
        pytest.skip(case.reason or "unsupported")
    ok = case.status in (Status.PASS, Status.SOFT_PASS)
    if canitoolcall_fixture.id in KNOWN:
        assert not ok, f"{canitoolcall_fixture.id} passes now: take it off the list"
        pytest.xfail("a known failure")
    bad = [f"{r.check}[{r.strategy}]: {r.detail}" for r in case.checks
           if r.status in (Status.FAIL, Status.ERROR)]
    assert ok, "\n".join(bad[:6])
