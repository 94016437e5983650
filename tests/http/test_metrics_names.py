"""``/metrics`` keeps its families: the same names, types, help and label names as before
the typed meter (``metrics_names.txt`` beside this file was written by the string-keyed
implementation, from this same workload: ``python -m tests.http.test_metrics_names``).

The workload touches every part that counts: chat, Messages and Responses requests, a
follow-up, a miss, a hosted tool, a volatile rule, a refused request, a draft model's
speculative decoding, checkpoints in RAM and on disk.
"""

from __future__ import annotations

import asyncio
import re
import sys
from pathlib import Path

import aiohttp
import pytest
from anthropic import AsyncAnthropic

from tests.http.conftest import serve, until_metrics

pytestmark = pytest.mark.http

GOLDEN = Path(__file__).with_name("metrics_names.txt")
SYSTEM = "You are a careful assistant who answers in one short sentence. " * 12
_TYPE = re.compile(r"^# TYPE (\S+) (\S+)$")
_HELP = re.compile(r"^# HELP (\S+) (.*)$")
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? ")


def families(text: str) -> list[str]:
    """One line per family: name, type, label names, help."""
    kinds: dict[str, str] = {}
    helps: dict[str, str] = {}
    labels: dict[str, set[str]] = {}
    for line in text.splitlines():
        if m := _TYPE.match(line):
            kinds[m[1]] = m[2]
        elif m := _HELP.match(line):
            helps[m[1]] = m[2]
        elif m := _SAMPLE.match(line):
            names = {kv.split("=", 1)[0] for kv in (m[2] or "").split(",") if kv}
            labels.setdefault(m[1], set()).update(names)
    return sorted(f"{name} {kinds[name]} [{','.join(sorted(labels.get(name, ())))}] "
                  f"{helps[name]}" for name in kinds)


async def workload(model: Path, draft: Path, tmp: Path) -> str:
    """The /metrics text after the workload."""
    async with serve(model, tmp / "ckpt", model__draft_path=str(draft),
                     speculative__source="draft", speculative__draft_min_p=0.0,
                     cache__ram_budget="2MiB",
                     server__volatile=[{"name": "stamp", "pattern": r"\d\d:\d\d"}]) as srv:
        chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi 10:00"}]
        r = await srv.client.chat.completions.create(model="m", messages=chat, max_tokens=8,
                                                     temperature=0)
        chat += [{"role": "assistant", "content": r.choices[0].message.content or ""},
                 {"role": "user", "content": "And?"}]
        await srv.client.chat.completions.create(model="m", messages=chat, max_tokens=8,
                                                 temperature=0)
        edited = [{"role": "system", "content": SYSTEM[:200] + "Changed. " + SYSTEM[200:]},
                  *chat[1:]]  # a miss: the system prompt changed early
        await srv.client.chat.completions.create(model="m", messages=edited, max_tokens=4,
                                                 temperature=0)
        await srv.client.responses.create(model="m", input="Hi", max_output_tokens=4,
                                          tools=[{"type": "web_search"}])  # type: ignore[list-item]
        anthropic = AsyncAnthropic(base_url=srv.url, api_key="x", max_retries=0)
        await anthropic.messages.create(model="m", max_tokens=4, messages=[
            {"role": "user", "content": "Hi"}])
        await anthropic.close()
        async with aiohttp.ClientSession() as http, \
                http.post(srv.url + "/v1/chat/completions", json={"messages": []}):
            pass
        # an idle lane is saved (engine.idle_save_s later) and its checkpoints written
        return await until_metrics(srv, lambda m: m.get("statecache_idle_saves_total", 0) >= 1
                                   and m.get("statecache_disk_write_queue") == 0)


async def test_metrics_keep_their_names_types_help_and_labels(
        hybrid_path: Path, draft_path: Path, tmp_path: Path) -> None:
    got = families(await workload(hybrid_path, draft_path, tmp_path))
    want = GOLDEN.read_text().splitlines()
    missing = sorted(set(want) - set(got))
    assert not missing, "families that changed or went missing:\n" + "\n".join(missing)


if __name__ == "__main__":  # writes metrics_names.txt from this checkout's /metrics
    import tempfile

    from tests.conftest import _synth

    with tempfile.TemporaryDirectory() as d:
        text = asyncio.run(workload(_synth("hybrid"), _synth("draft"), Path(d)))
    GOLDEN.write_text("\n".join(families(text)) + "\n")
    print(f"{len(families(text))} families written to {GOLDEN}", file=sys.stderr)
