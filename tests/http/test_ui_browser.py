"""The live page in a real browser: headless Chromium loads ``/ui`` from a proxy that
served an agent session with a subagent, runs the page's own JavaScript, and the DOM it
leaves must show both conversations parting from one shared prefix, the cached tokens
each request was told, and why the edited turn missed. It also saves a screenshot
(``STATECACHE_UI_SCREENSHOT=docs/ui.png`` keeps it there: docs/operations.md shows it).

Skipped, saying why, where no Chromium or Chrome is installed; CI installs Debian's
(``.ci/run``) and sets ``STATECACHE_REQUIRE_BROWSER``, which makes a missing browser a
failure there.
"""

from __future__ import annotations

import asyncio
import html
import os
import shutil
from html.parser import HTMLParser
from pathlib import Path

import pytest

from tests.http.conftest import Server, serve
from tests.http.ui_session import EDITED, MAIN, PAGE, SUB, agent_session

pytestmark = pytest.mark.http

BROWSERS = ("/usr/bin/chromium", "chromium", "chromium-browser", "google-chrome",
            "google-chrome-stable")
# as root in a sandbox with no network (/work/.library/env/machines/python.md)
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--hide-scrollbars")


def _browser() -> str | None:
    for name in BROWSERS:
        found = shutil.which(name)
        if found:
            return found
    return None


BROWSER = _browser()
if BROWSER is None:
    _why = ("no Chromium or Chrome found (looked for " + ", ".join(BROWSERS) +
            "); `apt-get install chromium` (Debian) runs it, and CI (.ci/run) does")
    if os.environ.get("STATECACHE_REQUIRE_BROWSER"):  # CI: a browser test that never runs
        pytest.fail(_why, pytrace=False)              # is a failure, not a skip
    pytest.skip(_why, allow_module_level=True)


class _Dom(HTMLParser):
    """The parts of the page the test reads: tree nodes, request rows, the miss cells."""

    def __init__(self) -> None:
        super().__init__()
        self.nodes: list[dict[str, str]] = []
        self.rows: list[dict[str, str]] = []
        self.misses: list[str] = []
        self.inserted: list[str] = []
        self._text: list[str] | None = None
        self._depth = 0
        self._ins: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "li" and "node" in a.get("class", "").split():
            self.nodes.append(a)
        if tag == "tr" and "data-cached" in a:
            self.rows.append(a)
        if tag == "td" and a.get("class") == "miss":
            self._text, self._depth = [], 1
        elif self._text is not None and tag == "td":
            self._depth += 1
        if tag == "ins":
            self._ins = []

    def handle_endtag(self, tag: str) -> None:
        if tag == "ins" and self._ins is not None:
            self.inserted.append("".join(self._ins))
            self._ins = None
        if tag == "td" and self._text is not None:
            self._depth -= 1
            if not self._depth:
                self.misses.append("".join(self._text))
                self._text = None

    def handle_data(self, data: str) -> None:
        if self._text is not None:
            self._text.append(data)
        if self._ins is not None:
            self._ins.append(data)


async def _chromium(url: str, profile: Path, *args: str) -> str:
    assert BROWSER is not None
    profile.mkdir(parents=True, exist_ok=True)
    proc = await asyncio.create_subprocess_exec(
        BROWSER, *FLAGS, f"--user-data-dir={profile}", "--virtual-time-budget=4000", *args, url,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout=90)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode == 0, err.decode(errors="replace")[-2000:]
    return out.decode()


async def _load(srv: Server, tmp: Path) -> _Dom:
    dom = _Dom()
    dom.feed(await _chromium(srv.url + "/ui", tmp / "profile-dom", "--dump-dom"))
    return dom


async def test_the_page_in_chromium_after_an_agent_session_with_a_subagent(
        hybrid_path: Path, tmp_path: Path) -> None:
    async with serve(hybrid_path, tmp_path / "ckpt") as srv:
        sent = await agent_session(srv.client)
        dom = await _load(srv, tmp_path)
        shot = tmp_path / "ui.png"
        await _chromium(srv.url + "/ui", tmp_path / "profile-shot", f"--screenshot={shot}",
                        "--window-size=1280,1080")
    # both conversations part from one node, at the page where their shared prefix ends
    parting = [n for n in dom.nodes if {MAIN, SUB} <= set(n["data-sessions"].split())
               and int(n["data-branches"]) >= 2]
    assert len(parting) == 1, dom.nodes
    tokens = int(parting[0]["data-tokens"])
    assert sent.shared // PAGE * PAGE <= tokens <= sent.shared + PAGE
    assert parting[0]["data-checkpoints"], "the shared prefix is a checkpoint of its own"
    # every request with the cached tokens its client was told, newest first
    assert [(int(r["data-prompt"]), int(r["data-cached"])) for r in dom.rows] == sent.usage[::-1]
    # the edited turn's miss, with the text that changed
    assert dom.misses[0].startswith("earlier message edited at token"), dom.misses
    assert dom.inserted and html.unescape(dom.inserted[0]).strip("…") in EDITED
    assert shot.stat().st_size > 10_000 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    keep = os.environ.get("STATECACHE_UI_SCREENSHOT")
    if keep:
        shutil.copyfile(shot, keep)


async def test_the_page_asks_for_the_admin_key_and_works_with_it(
        hybrid_path: Path, tmp_path: Path) -> None:
    """With keys configured, the browser's Basic credentials (any user, the admin key)
    open the page, and its requests for data carry them too."""
    key = "sk-admin"
    async with serve(hybrid_path, tmp_path / "ckpt", server__api_keys={"sk-alice": "alice"},
                     server__admin_key=key) as srv:
        denied = await _chromium(srv.url + "/ui", tmp_path / "p1", "--dump-dom")
        assert "fetch(" not in denied  # the page itself is not served without the key
        host = srv.url.removeprefix("http://")
        page = await _chromium(f"http://admin:{key}@{host}/ui", tmp_path / "p2", "--dump-dom")
    assert 'class="ok"' in page and "live ·" in page, page[-3000:]
