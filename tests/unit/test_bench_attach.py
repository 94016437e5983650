"""The bench gives each of statecache's records the engine's own lines for that request,
also when a reply reaches the client before its lines reach the log."""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

from bench.harness import Record
from bench.run import _attach_server_facts
from bench.servers import Server


def _lines(i: int) -> str:
    return (f"12:00:00 DEBUG statecache: phases r{i} · queue 0.1 ms · plan 0.2 ms (hand-off 0.0, "
            f"restore 0.0) · prefill {i}.0 ms in 1 steps (checkpoints 0.0 ms) · TTFT {i}.5 ms\n"
            f"12:00:00 INFO statecache: Done · input {100 + i} · cached {i} · prefilled 100 · "
            f"output 8 · TTFT 0.01 s · restore {i} ms · checkpoints +0 (0 B)\n")


def _agent(n: int) -> Any:
    recs = [Record("statecache", "m", "base", "s", k, "follow", 0.1, 0.2, 100, 0, 100, 8, None)
            for k in range(n)]
    return SimpleNamespace(records=recs)


def test_each_record_gets_its_own_request_lines_even_when_they_come_late(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_text(_lines(1) + _lines(2))
    proc = cast(subprocess.Popen[bytes], SimpleNamespace(pid=-1))
    srv = Server("statecache", "http://127.0.0.1:1", proc, log)
    first = _agent(2)
    _attach_server_facts(srv, [first], sequential=True)
    assert [r.restore_ms for r in first.records] == [1.0, 2.0]
    # the next agent's last reply arrived before the server logged its lines
    second = _agent(2)
    with log.open("a") as f:
        f.write(_lines(3))

    def late() -> None:
        time.sleep(0.3)
        with log.open("a") as f:
            f.write(_lines(4))

    t = threading.Thread(target=late)
    t.start()
    _attach_server_facts(srv, [second], sequential=True)
    t.join()
    assert [r.restore_ms for r in second.records] == [3.0, 4.0]
    assert [r.phases_ms["prefill"] for r in second.records if r.phases_ms] == [3.0, 4.0]
