"""Peak RSS of a real ``statecache serve`` process while it answers one huge request.

    .venv/bin/python -m tests.http.rss_probe [--mb 31.5] [--model models/hybrid-tiny.gguf]
        [--root DIR] [--concurrent 1]

Starts the server from ``--root`` (a checkout; default this one) on a free port, sends
one small request, reads the process's peak RSS (VmHWM), then posts ``--concurrent``
bodies of ``--mb`` MB at once (one user message of that size), and reads it again.
Prints one line per measurement.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc status")


def post(url: str, body: bytes, timeout: float = 600.0) -> tuple[int, str]:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()[:200]
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()[:200]
    except OSError as e:  # the server may close the connection before reading it all
        return -1, f"{type(e).__name__}: {e}"


def _wait_ready(url: str, proc: subprocess.Popen[bytes], deadline: float) -> None:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=1.0):
                return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError("the server did not start in time")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.http.rss_probe")
    ap.add_argument("--mb", type=float, default=31.5)
    ap.add_argument("--model", default=str(ROOT / "models" / "hybrid-tiny.gguf"))
    ap.add_argument("--root", type=Path, default=ROOT)
    ap.add_argument("--concurrent", type=int, default=1)
    args = ap.parse_args(argv)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "proxy", "serve", "--model", args.model,
               "--port", str(port), "--lanes", "1", "--no-cache"]
        env = {**os.environ, "PYTHONPATH": str(args.root), "HOME": tmp}
        proc = subprocess.Popen(cmd, cwd=args.root, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        try:
            _wait_ready(url, proc, time.monotonic() + 120)
            small = json.dumps({"messages": [{"role": "user", "content": "hi"}],
                                "max_tokens": 2}).encode()
            post(url + "/v1/chat/completions", small)
            base = peak_rss_mb(proc.pid)
            content = "a" * int(args.mb * 1e6 - 60)
            big = json.dumps({"messages": [{"role": "user", "content": content}],
                              "max_tokens": 2}).encode()
            t0 = time.monotonic()
            with concurrent.futures.ThreadPoolExecutor(args.concurrent) as ex:
                results = list(ex.map(lambda _: post(url + "/v1/chat/completions", big),
                                      range(args.concurrent)))
            dt = time.monotonic() - t0
            peak = peak_rss_mb(proc.pid)
            alive = post(url + "/v1/chat/completions", small)[0]
        finally:
            proc.terminate()
            proc.wait(30)
    print(f"root={args.root} body={len(big) / 1e6:.1f} MB x{args.concurrent}")
    for status, text in results:
        print(f"  answer: {status} {text}")
    print(f"  peak RSS before: {base:.0f} MiB; after: {peak:.0f} MiB (+{peak - base:.0f} MiB); "
          f"{dt:.1f} s; next request: {alive}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
