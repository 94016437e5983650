"""canitoolcall's conformance suite (469 recorded outputs, 9 families) through our
parsers, every chunking strategy (tools/toolcall_conformance.py says how fixtures map to
templates and how replies are cut into units).

A fixture passes when canitoolcall's checks give pass or soft pass (whitespace at the
ends); an ``expected_error`` fixture passes when we answer in one of the graceful ways
its spec accepts. Every fixture is supported and passes.
"""

from __future__ import annotations

from canitoolcall.fixtures import Fixture
from canitoolcall.results import Status
from canitoolcall.runner import family_for

from tools.toolcall_conformance import StatecacheAdapter

ADAPTER = StatecacheAdapter()


def test_conformance(canitoolcall_fixture: Fixture) -> None:
    case = ADAPTER.replay(canitoolcall_fixture, family_for(canitoolcall_fixture))
    assert case.status is not Status.UNSUPPORTED, case.reason
    bad = [f"{r.check}[{r.strategy}]: {r.detail}" for r in case.checks
           if r.status in (Status.FAIL, Status.ERROR)]
    assert case.status in (Status.PASS, Status.SOFT_PASS), "\n".join(bad[:6])
