"""``statecache serve`` as a user runs it: a process, a port, a stream, Ctrl-C."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from openai import OpenAI

from tests.http.proc import serve_process

pytestmark = pytest.mark.http


def test_serve_streams_and_shuts_down_cleanly(hybrid_path: Path, tmp_path: Path) -> None:
    # flags override the file (port 1 would fail)
    with serve_process(hybrid_path, tmp_path, "[server]\nport = 1\nlanes = 1\n") as p:
        client = OpenAI(base_url=f"{p.url}/v1", api_key="unused", max_retries=0)
        stream = client.chat.completions.create(
            model="x", messages=[{"role": "user", "content": "Hello there"}],
            max_tokens=12, temperature=0, stream=True)
        deltas = [c.choices[0].delta for c in stream if c.choices]
        text = "".join((d.content or "") + ((d.model_extra or {}).get("reasoning_content") or "")
                       for d in deltas)
        assert len(text) > 0
        client.close()
        p.proc.send_signal(signal.SIGINT)
        out = p.output()
        rc = p.proc.returncode
    assert rc == 0, out
    assert "Done · input" in out
    # the lane's state was kept on disk at shutdown
    assert list((tmp_path / "ckpt").glob("*.ckpt")), out
