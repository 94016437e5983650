"""The live page of the cache: ``GET /ui`` and the JSON it polls, ``GET /admin/ui.json``.

One self-contained HTML file (``static/ui.html``: its own CSS and JavaScript, nothing
from elsewhere) that asks for ``/admin/ui.json`` once a second while it is shown (every
10 s while its tab is hidden) and draws:

- the lanes: the conversation (session) each holds, its tokens, whether it decodes,
  prefills or is idle, its request's progress and tokens/s;
- the checkpoint tree (proxy/api/ui_tree.py): conversations as branches of the prefixes
  they share, each resumable point with its tokens, role, kind, tiers and bytes, and the
  points gone since an earlier look;
- the last requests: prompt, cached, prefilled, TTFT, and why one missed, with the text
  on each side of the difference;
- each tier against its budget (a store: whether it answers, what went in and out),
  and each tier that is off, with why; the share of prompt tokens reused over the last
  ten minutes (from the last requests, ``GET /admin/requests``).

Both routes are admin routes (proxy/api/auth.py): open where no key is configured,
behind ``server.admin_key`` otherwise (a browser gets a Basic challenge: any user name,
the admin key as password), and absent with ``server.admin = false``. Prompt text (the
previews, the miss excerpts) is on them as on ``/admin/checkpoints``.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from proxy.api.appstate import ENGINE, RECENT, STARTED, UI_TREE
from proxy.api.auth import UI_PATH
from proxy.api.ui_tree import TreeView
from statecache.pool import PoolStats

PAGE = Path(__file__).with_name("static") / "ui.html"
DATA_PATH = "/admin/ui.json"
HISTORY_S = 600  # the hit-ratio chart's window...
BUCKET_S = 20  # ...in bars of this many seconds
MAX_REQUESTS = 12  # requests listed
CHALLENGE = 'Basic realm="statecache admin", charset="UTF-8"'
# the page runs only its own inline script and style, and asks only this server
_PAGE_HEADERS = {"Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; "
                                            "style-src 'unsafe-inline'; connect-src 'self'; "
                                            "img-src data:",
                 "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"}
# what the page draws of each tier, and of a store's own traffic
_DRAWN = ("name", "label", "where", "status", "hits", "entries", "bytes", "budget", "evictions")
_TRAFFIC = ("up", "queue", "queue_bytes", "read_bytes", "written_bytes")


@dataclass(slots=True, frozen=True)
class Page:
    """The page's bytes, read once when the app is made, and their ETag."""

    body: bytes
    etag: str

    @classmethod
    def read(cls, path: Path = PAGE) -> Page:
        body = path.read_bytes()
        return cls(body, '"' + hashlib.sha256(body).hexdigest()[:16] + '"')

    async def serve(self, request: web.Request) -> web.Response:
        """``GET /ui``: the page, or 304 to a browser that holds it."""
        headers = {"ETag": self.etag, "Cache-Control": "no-cache", **_PAGE_HEADERS}
        if request.headers.get("If-None-Match") == self.etag:
            return web.Response(status=304, headers=headers)
        return web.Response(body=self.body, content_type="text/html", charset="utf-8",
                            headers=headers)


def add_ui(app: web.Application, page_size: int) -> None:
    """Add the page's two routes (call where the admin routes are added)."""
    app[UI_TREE] = TreeView(page_size)
    app.router.add_get(UI_PATH, Page.read().serve)
    app.router.add_get(DATA_PATH, ui_data)
    app.on_response_prepare.append(_challenge)


async def _challenge(request: web.Request, resp: web.StreamResponse) -> None:
    """A browser asks for the admin key when the page answers 401 with a challenge."""
    if request.path == UI_PATH and resp.status == 401:
        resp.headers["WWW-Authenticate"] = CHALLENGE


async def ui_data(request: web.Request) -> web.Response:
    """Everything the page draws, in one answer."""
    app = request.app
    engine = app[ENGINE]
    now = time.time()
    lanes = engine.describe_lanes()
    tiers = engine.tiers()
    tree = app[UI_TREE].build(engine.describe_checkpoints(), engine.checkpoint_pages(),
                              lanes, now)
    recent: list[dict[str, Any]] = [*app[RECENT]]
    body = {
        "time": now, "started": app[STARTED], "model": engine.model_name,
        "model_file": engine.model_file,
        "n_ctx": engine.n_ctx, "queue": engine.queue(),
        "lanes": [{k: v for k, v in lane.items() if k != "pages"} for lane in lanes],
        "tree": tree,
        "requests": requests(recent, engine.recent_misses()),
        "history": history(recent, now),
        "tiers": tier_rows(tiers.get("stats")),
    }
    return web.json_response(body, headers={"Cache-Control": "no-store"}, dumps=_compact)


def tier_rows(stats: PoolStats | None) -> list[dict[str, Any]]:
    """Each tier the pool holds, nearest first, with what the page draws of it; then
    each tier that is off, by its label, and why."""
    if stats is None:  # the cache is off
        return []
    rows: list[dict[str, Any]] = []
    for t, is_open in [(t, True) for t in stats.tiers] + [(t, False) for t in stats.off]:
        row: dict[str, Any] = {k: getattr(t, k) for k in _DRAWN}
        row["open"] = is_open
        if t.store is not None:
            row["store"] = {k: getattr(t.store, k) for k in _TRAFFIC}
        rows.append(row)
    return rows


def _compact(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


def _generation(r: Mapping[str, Any]) -> bool:
    return "prompt_tokens" in r


def requests(recent: list[dict[str, Any]], misses: Iterable[Mapping[str, Any]]
             ) -> list[dict[str, Any]]:
    """The last generations and refusals, newest first, each miss with its two excerpts."""
    by_id = {m.get("request_id"): m for m in misses}
    out = []
    for r in reversed(recent):
        if not _generation(r) and int(r.get("status") or 0) < 400:
            continue  # a probe of ``/``, a model list
        row = {k: v for k, v in r.items() if v is not None}
        m = by_id.get(r.get("request_id"))
        if m is not None:
            row["miss_at"] = {k: m.get(k) for k in ("cause", "token", "message", "role",
                                                    "old", "new", "known")}
        out.append(row)
        if len(out) == MAX_REQUESTS:
            break
    return out


def history(recent: list[dict[str, Any]], now: float) -> list[dict[str, Any]]:
    """Prompt and cached tokens per ``BUCKET_S`` over the last ``HISTORY_S``, oldest first."""
    n = HISTORY_S // BUCKET_S
    end = (int(now) // BUCKET_S + 1) * BUCKET_S
    rows = [{"t": end - (n - i) * BUCKET_S, "prompt": 0, "cached": 0, "requests": 0}
            for i in range(n)]
    for r in recent:
        t = float(r.get("time") or 0)
        i = n - 1 - int((end - t) // BUCKET_S)
        if _generation(r) and 0 <= i < n:
            rows[i]["prompt"] += int(r.get("prompt_tokens") or 0)
            rows[i]["cached"] += int(r.get("cached_tokens") or 0)
            rows[i]["requests"] += 1
    return rows
