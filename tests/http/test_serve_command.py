"""``statecache serve`` as a user runs it: a process, a port, a stream, Ctrl-C."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from openai import OpenAI

pytestmark = pytest.mark.http


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_serve_streams_and_shuts_down_cleanly(hybrid_path: Path, tmp_path: Path) -> None:
    port = _free_port()
    ckpt = tmp_path / "ckpt"
    config = tmp_path / "statecache.toml"
    config.write_text(f'[server]\nport = 1\nlanes = 1\n[cache]\ndisk_path = "{ckpt}"\n')
    # flags override the file (port 1 would fail)
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy", "serve", "--config", str(config),
         "--model", str(hybrid_path), "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    assert r.status == 200
                    break
            except OSError:
                assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
                assert time.monotonic() < deadline, "server did not come up"
                time.sleep(0.3)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        stream = client.chat.completions.create(
            model="x", messages=[{"role": "user", "content": "Hello there"}],
            max_tokens=12, temperature=0, stream=True)
        deltas = [c.choices[0].delta for c in stream if c.choices]
        text = "".join((d.content or "") + ((d.model_extra or {}).get("reasoning_content") or "")
                       for d in deltas)
        assert len(text) > 0
        client.close()
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert "Done · input" in out
    # the lane's state was kept on disk at shutdown
    assert list(ckpt.glob("*.ckpt")), out
