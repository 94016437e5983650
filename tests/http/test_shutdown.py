"""Signals and clients that leave, against ``statecache serve`` as a process: a stream
ends with a finish reason and ``[DONE]``, the process exits 0 quickly with the cache on
disk, a second signal loses nothing, and work stops when the client leaves (also while
queued and during prefill)."""

from __future__ import annotations

import json
import re
import signal
import socket
import time
from pathlib import Path

import pytest
from openai import OpenAI

from tests.http.proc import open_stream, serve_process, sse_events

pytestmark = pytest.mark.http

LONG = {"model": "x", "messages": [{"role": "user", "content": "Go on and on. " * 10}],
        "max_tokens": 3000, "temperature": 0}


def _stream_then_signal(model: Path, tmp: Path, signals: int) -> tuple[list[str], str, float,
                                                                        int]:
    with serve_process(model, tmp, "[server]\nlanes = 1\n") as p:
        conn, resp = open_stream(p.port, LONG)
        events = sse_events(resp)
        got = [next(events) for _ in range(5)]  # it streams
        t0 = time.monotonic()
        for _ in range(signals):
            p.proc.send_signal(signal.SIGTERM)
            time.sleep(0.05)
        got += list(events)
        conn.close()
        out = p.output()
        return got, out, time.monotonic() - t0, p.proc.returncode


@pytest.mark.parametrize("signals", [1, 2])
def test_sigterm_ends_the_stream_properly_and_keeps_the_cache(
    signals: int, hybrid_path: Path, tmp_path: Path
) -> None:
    got, out, took, rc = _stream_then_signal(hybrid_path, tmp_path, signals)
    print(f"{signals} SIGTERM: exit {rc} {took:.2f} s after the first signal")  # pytest -s
    assert rc == 0, out
    assert took < 10, out  # well inside a container runtime's 10 s grace
    assert got[-1] == "[DONE]", got[-3:]
    finals = [json.loads(e) for e in got[:-1] if "finish_reason\":\"" in e]
    assert finals and finals[-1]["choices"][0]["finish_reason"] == "length", got[-3:]
    generated = sum(len(json.loads(e)["choices"][0]["delta"].get("content") or "") +
                    len(json.loads(e)["choices"][0]["delta"].get("reasoning_content") or "")
                    for e in got[:-1] if json.loads(e).get("choices"))
    assert generated < 3000  # cut short by the signal, not run to max_tokens
    assert "shut down in" in out
    assert list((tmp_path / "ckpt").glob("*.ckpt")), out  # the lane's state was kept


def test_client_leaving_during_prefill_stops_the_prefill(hybrid_path: Path,
                                                         tmp_path: Path) -> None:
    # Small steps make the 15,000-token prefill take many of them (seconds); the client
    # leaves as soon as the engine has the request.
    with serve_process(hybrid_path, tmp_path, "[engine]\nstep_tokens = 16\n") as p:
        body = json.dumps({"model": "x", "stream": True, "max_tokens": 4,
                           "messages": [{"role": "user", "content": "word " * 3000}]})
        s = socket.create_connection(("127.0.0.1", p.port))
        s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                  f"application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode())
        deadline = time.monotonic() + 30
        while p.metric("statecache_active_requests") != 1:
            assert time.monotonic() < deadline, "the request never became active"
            time.sleep(0.02)
        time.sleep(0.2)
        s.close()  # before the first token
        # the engine ends it (a prefill not stopped ends too, prefilled in full)
        deadline = time.monotonic() + 120
        while p.metric("statecache_active_requests") != 0:
            assert time.monotonic() < deadline, "the request never ended"
            time.sleep(0.05)
        p.proc.send_signal(signal.SIGINT)
        out = p.output()
    m = re.search(r"Done · input ([\d,]+) · cached \d+ · prefilled ([\d,]+).*cancelled", out)
    assert m, out
    n_in, prefilled = (int(g.replace(",", "")) for g in m.groups())
    assert prefilled < n_in, out


def test_client_leaving_while_queued_is_never_started(hybrid_path: Path,
                                                      tmp_path: Path) -> None:
    with serve_process(hybrid_path, tmp_path, "[server]\nlanes = 1\n") as p:
        conn, resp = open_stream(p.port, LONG)  # holds the only lane
        events = sse_events(resp)
        next(events)
        s = socket.create_connection(("127.0.0.1", p.port))
        body = json.dumps({"model": "x", "max_tokens": 4,
                           "messages": [{"role": "user", "content": "queued"}]})
        s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                  f"application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode())
        # (each wait until the server did it: how soon is a busy machine's to say)
        p.until("queued", lambda: p.metric("statecache_queue_depth") == 1)
        s.close()
        p.until("dropped", lambda: p.metric("statecache_queue_depth") == 0)
        conn.close()
        p.until("the lane let go", lambda: p.metric("statecache_active_requests") == 0)
        p.proc.send_signal(signal.SIGINT)
        out = p.output()
    assert "left while queued" in out, out
    assert out.count("Started ·") == 1, out


def test_sigkill_after_a_turn_loses_seconds_not_the_session(hybrid_path: Path,
                                                             tmp_path: Path) -> None:
    # An idle lane is saved in full after engine.idle_save_s and the pool's writer
    # puts full states on disk at once: a killed proxy's successor resumes the session.
    conf = "[server]\nlanes = 1\n[engine]\nidle_save_s = 0.5\n"
    messages: list[dict[str, str]] = [{"role": "user", "content": "Remember this. " * 20}]
    with serve_process(hybrid_path, tmp_path, conf) as p:
        client = OpenAI(base_url=f"{p.url}/v1", api_key="unused", max_retries=0)
        r1 = client.chat.completions.create(model="x", messages=messages,  # type: ignore[arg-type]
                                            max_tokens=16, temperature=0)
        client.close()
        assert r1.usage is not None
        held = r1.usage.prompt_tokens + r1.usage.completion_tokens
        # the idle save and its write (not a second after the turn: how soon is a busy
        # machine's to say)
        p.until("the idle lane's full state on disk", lambda: any(
            c["kind"] == "full" and "disk" in c["tiers"] and c["n"] >= held - 32  # type: ignore[operator]
            for c in p.checkpoints()))
        p.proc.kill()
        p.proc.wait()
    messages += [{"role": "assistant", "content": r1.choices[0].message.content or "",
                  "reasoning_content": (r1.choices[0].message.model_extra or {}).get(
                      "reasoning_content") or ""},
                 {"role": "user", "content": "And now?"}]
    with serve_process(hybrid_path, tmp_path, conf) as p:
        client = OpenAI(base_url=f"{p.url}/v1", api_key="unused", max_retries=0)
        r2 = client.chat.completions.create(model="x", messages=messages,  # type: ignore[arg-type]
                                            max_tokens=4, temperature=0)
        client.close()
    assert r2.usage is not None and r2.usage.prompt_tokens_details is not None
    assert (r2.usage.prompt_tokens_details.cached_tokens or 0) >= held - 32
