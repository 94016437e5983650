"""A local HTTP server (127.0.0.1) that answers as the Hugging Face Hub does the requests
``huggingface_hub`` makes to download a file: the repo's file list
(``GET /api/models/{org}/{repo}/tree/{revision}``) and the file itself
(``HEAD`` and ``GET /{org}/{repo}/resolve/{revision}/{path}``, with ``X-Repo-Commit``,
``ETag`` and ``X-Linked-Size``, ``Range`` answered with 206), errors as the Hub marks them
(``X-Error-Code: RepoNotFound``, ``EntryNotFound``, ``GatedRepo``). It runs in a thread of
its own, so that code under test may call it synchronously or from another process.

``drop_after``: the first GET of a file closes the connection after that many bytes, as a
network failure would; ``token``: every request needs ``Authorization: Bearer <token>``.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

COMMIT = "fedcba9876543210fedcba9876543210fedcba98"


@dataclass
class Hub:
    repos: dict[str, dict[str, Path]]  # repo id -> path in repo -> local file
    token: str = ""
    drop_after: int = 0
    requests: list[tuple[str, str, str]] = field(default_factory=list)  # method, path, range
    url: str = ""
    _dropped: set[str] = field(default_factory=set)

    def _refuse(self, request: web.Request) -> web.Response | None:
        if self.token and request.headers.get("Authorization") != f"Bearer {self.token}":
            return web.Response(status=401, headers={"X-Error-Code": "GatedRepo"})
        return None

    async def tree(self, request: web.Request) -> web.Response:
        self.requests.append((request.method, request.path, ""))
        repo = f"{request.match_info['org']}/{request.match_info['repo']}"
        refused = self._refuse(request)
        if refused is not None:
            return refused
        if repo not in self.repos:
            return web.Response(status=404, headers={"X-Error-Code": "RepoNotFound"})
        out = []
        for rel, local in sorted(self.repos[repo].items()):
            size = local.stat().st_size
            sha = _sha256(local)
            out.append({"type": "file", "oid": sha[:40], "size": size, "path": rel,
                        "lfs": {"oid": sha, "size": size, "pointerSize": 134}})
        return web.json_response(out)

    async def resolve(self, request: web.Request) -> web.StreamResponse:
        rng = request.headers.get("Range", "")
        self.requests.append((request.method, request.path, rng))
        refused = self._refuse(request)
        if refused is not None:
            return refused
        repo = f"{request.match_info['org']}/{request.match_info['repo']}"
        if repo not in self.repos:
            return web.Response(status=404, headers={"X-Error-Code": "RepoNotFound"})
        local = self.repos[repo].get(request.match_info["path"])
        if local is None:
            return web.Response(status=404, headers={"X-Error-Code": "EntryNotFound",
                                                     "X-Repo-Commit": COMMIT})
        data = local.read_bytes()
        sha = _sha256(local)
        headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{sha}"', "X-Linked-Etag": f'"{sha}"',
                   "X-Linked-Size": str(len(data)), "Accept-Ranges": "bytes"}
        if request.method == "HEAD":
            return web.Response(status=200, headers={**headers,
                                                     "Content-Length": str(len(data))})
        start = int(rng.removeprefix("bytes=").split("-")[0]) if rng else 0
        body = data[start:]
        resp = web.StreamResponse(status=206 if start else 200, headers={
            **headers, "Content-Length": str(len(body)),
            **({"Content-Range": f"bytes {start}-{len(data) - 1}/{len(data)}"} if start else {})})
        await resp.prepare(request)
        key = request.path
        if self.drop_after and not start and key not in self._dropped:
            self._dropped.add(key)  # the first try dies halfway, as a dropped link would
            await resp.write(body[:self.drop_after])
            assert request.transport is not None
            request.transport.close()
            return resp
        await resp.write(body)
        await resp.write_eof()
        return resp


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@contextmanager
def running(hub: Hub) -> Iterator[Hub]:
    """Serve ``hub`` on a free port of 127.0.0.1 until the block ends."""
    app = web.Application()
    app.router.add_get("/api/models/{org}/{repo}/tree/{rev}", hub.tree)
    app.router.add_route("HEAD", "/{org}/{repo}/resolve/{rev}/{path:.+}", hub.resolve)
    app.router.add_get("/{org}/{repo}/resolve/{rev}/{path:.+}", hub.resolve, allow_head=False)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app, access_log=None)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = runner.addresses[0][1]
    hub.url = f"http://127.0.0.1:{port}"
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.run_until_complete(runner.cleanup())
        loop.close()
