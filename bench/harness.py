"""An agent harness over HTTP: send a turn, stream the reply, append it, repeat.

The assistant message appended to the history is the server's reply as
returned: its ``content``, ``reasoning_content`` and ``tool_calls``. A planned
tool-result turn answers the previous reply's tool calls with ``tool``
messages; when the reply had none (random-weight models never emit the
tool-call tokens), the result is sent as a user message instead, so every
request stays valid for every server.
"""

from __future__ import annotations

import http.client
import json
import re
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from bench.workload import Session, edit_middle

TEMPLATE_KWARGS = {"preserve_thinking": True}


@dataclass(slots=True)
class Record:
    """One request, as measured by the client (and reported by the server)."""

    system: str
    model: str
    variant: str
    session: str
    turn: int
    kind: str  # first | follow | repeat | edit
    ttft_s: float
    total_s: float
    prompt_tokens: int | None
    cached_tokens: int | None
    prefilled: int | None
    completion_tokens: int
    decode_tps: float | None
    new_tokens: int | None = None  # tokens beyond what the server saw last turn
    restore_ms: float | None = None  # statecache's own log line
    phases_ms: dict[str, float] | None = None  # statecache's debug line, per phase
    ideal_prefill_s: float | None = None  # new tokens at their context length (bench.ideal)
    peak_rss_kb: int | None = None
    repeat: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class Reply:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    timings: dict[str, Any] | None = None
    ttft_s: float = 0.0
    total_s: float = 0.0
    n_deltas: int = 0
    t_last: float = 0.0

    def message(self, keep_reasoning: bool) -> dict[str, Any]:
        m: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning and keep_reasoning:
            m["reasoning_content"] = self.reasoning
        if self.tool_calls:
            m["tool_calls"] = self.tool_calls
        return m


def _merge_calls(calls: list[dict[str, Any]], deltas: list[dict[str, Any]]) -> None:
    for d in deltas:
        i = d.get("index", len(calls))
        while len(calls) <= i:
            calls.append({"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
        c = calls[i]
        c["id"] = d.get("id") or c["id"]
        f = d.get("function") or {}
        c["function"]["name"] += f.get("name") or ""
        c["function"]["arguments"] += f.get("arguments") or ""


def _sse_lines(url: str, body: dict[str, Any],
               path: str = "/v1/chat/completions") -> Iterator[str]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=900)
    try:
        conn.request("POST", path, body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read().decode()[:500]}")
        for raw in resp:
            yield raw.decode("utf-8").rstrip("\r\n")
    finally:
        conn.close()


def stream_chat(url: str, body: dict[str, Any]) -> Reply:
    """POST a streaming chat request; TTFT is the first non-empty delta."""
    r = Reply()
    t0 = time.perf_counter()
    first: float | None = None
    for line in _sse_lines(url, body):
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        obj = json.loads(data)
        if "error" in obj:
            raise RuntimeError(f"stream error: {obj['error']}")
        r.usage = obj.get("usage") or r.usage
        r.timings = obj.get("timings") or r.timings
        for ch in obj.get("choices") or []:
            d = ch.get("delta") or {}
            got = False
            if d.get("content"):
                r.content += d["content"]
                got = True
            if d.get("reasoning_content"):
                r.reasoning += d["reasoning_content"]
                got = True
            if d.get("tool_calls"):
                _merge_calls(r.tool_calls, d["tool_calls"])
                got = True
            if got:
                now = time.perf_counter()
                first = first if first is not None else now
                r.t_last = now
                r.n_deltas += 1
    r.total_s = time.perf_counter() - t0
    r.ttft_s = (first if first is not None else time.perf_counter()) - t0
    r.t_last = r.t_last - t0 if r.t_last else r.total_s
    return r


def _counts(system: str, r: Reply) -> tuple[int | None, int | None, int | None, int]:
    """(prompt, cached, prefilled, completion) tokens as the server reports them."""
    u = r.usage or {}
    prompt: int | None = u.get("prompt_tokens")
    completion = u.get("completion_tokens") or r.n_deltas
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens")
    if r.timings and "prompt_n" in r.timings:  # llama-server
        n_pre = int(r.timings["prompt_n"])
        n_cached = int(r.timings.get("cache_n", 0))
        prompt = prompt if prompt is not None else n_pre + n_cached
        return prompt, n_cached, n_pre, completion
    if system == "llama_cpp.server":  # reports no cached tokens: prefill unknown
        return prompt, None, None, completion
    prefilled = prompt - cached if prompt is not None and cached is not None else None
    return prompt, cached, prefilled, completion


def _decode_tps(r: Reply, completion: int) -> float | None:
    span = r.t_last - r.ttft_s
    return (completion - 1) / span if completion > 1 and span > 0 else None


@dataclass(slots=True)
class Agent:
    """One conversation against one server."""

    url: str
    system: str
    model: str
    variant: str
    session: Session
    keep_reasoning: bool = True
    repeat: int = 0
    messages: list[dict[str, Any]] = field(default_factory=list)
    records: list[Record] = field(default_factory=list)
    last_reply: Reply | None = None

    def __post_init__(self) -> None:
        self.messages = [{"role": "system", "content": self.session.system}]

    def _body(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        return {"model": "bench", "messages": messages, "tools": list(self.session.tools),
                "stream": True, "stream_options": {"include_usage": True},
                "temperature": 0.0, "seed": self.session.seed,
                "max_tokens": self.session.max_tokens,
                "chat_template_kwargs": TEMPLATE_KWARGS}

    def _send(self, messages: list[dict[str, Any]], turn: int, kind: str) -> Reply:
        r = stream_chat(self.url, self._body(messages))
        prompt, cached, prefilled, completion = _counts(self.system, r)
        self.records.append(Record(
            self.system, self.model, self.variant, self.session.name, turn, kind, r.ttft_s,
            r.total_s, prompt, cached, prefilled, completion, _decode_tps(r, completion),
            repeat=self.repeat))
        return r

    def _append_turn(self, i: int) -> None:
        t = self.session.turns[i]
        prev = self.last_reply
        if t.kind == "tool" and prev is not None and prev.tool_calls:
            for c in prev.tool_calls:
                self.messages.append({"role": "tool", "tool_call_id": c["id"], "content": t.text})
        elif t.kind == "tool":
            self.messages.append({"role": "user", "content": "Tool output:\n" + t.text})
        else:
            self.messages.append({"role": "user", "content": t.text})

    def turn(self, i: int) -> Reply:
        """Send turn ``i`` on top of the history, then append the reply."""
        self._append_turn(i)
        r = self._send(self.messages, i, "first" if i == 0 else "follow")
        self.messages.append(r.message(self.keep_reasoning))
        self.last_reply = r
        return r

    def resend_last(self) -> Reply:
        """The exact request of the last turn again (a client retry)."""
        return self._send(self.messages[:-1], len(self.session.turns) - 1, "repeat")

    def edit_and_continue(self, seed: int) -> Reply:
        """Rewrite a message in the middle of the history and send one more turn."""
        msgs = edit_middle(self.messages, seed)
        msgs.append({"role": "user", "content": "Continue."})
        return self._send(msgs, len(self.session.turns), "edit")

    def run(self) -> list[Record]:
        for i in range(len(self.session.turns)):
            self.turn(i)
        return self.records


_DONE = re.compile(r"Done · input ([\d,]+) · cached ([\d,]+) · prefilled ([\d,]+) · output "
                   r"([\d,]+) · TTFT ([\d.]+) s · restore (\d+) ms")
_PHASES = re.compile(r"phases \S+ · queue ([\d.]+) ms · plan ([\d.]+) ms \(hand-off ([\d.]+), "
                     r"restore ([\d.]+)\) · prefill ([\d.]+) ms in (\d+) steps \(checkpoints "
                     r"([\d.]+) ms\) · TTFT ([\d.]+) ms")
PHASES = ("queue", "plan", "hand-off", "restore", "prefill", "prefill steps", "checkpoints",
          "engine TTFT")


def statecache_log_lines(log: str) -> list[dict[str, Any]]:
    """The proxy's ``Done`` lines, in order, each with the ``phases`` line logged just
    before it at debug level (``phases``: None when the log is at info)."""
    out: list[dict[str, Any]] = []
    phases: dict[str, float] | None = None
    for line in log.splitlines():
        if (p := _PHASES.search(line)) is not None:
            phases = dict(zip(PHASES, (float(x) for x in p.groups()), strict=True))
        elif (m := _DONE.search(line)) is not None:
            out.append({"input": int(m[1].replace(",", "")), "cached": int(m[2].replace(",", "")),
                        "prefilled": int(m[3].replace(",", "")), "restore_ms": float(m[6]),
                        "phases": phases})
            phases = None
    return out


def stream_chat_completion(url: str, prompt: str, max_tokens: int) -> tuple[float, int, float]:
    """A streaming ``/v1/completions`` request: (TTFT, tokens, seconds from first to last)."""
    body = {"model": "bench", "prompt": prompt, "stream": True, "temperature": 0.0,
            "max_tokens": max_tokens, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = last = 0.0
    n = 0
    usage: dict[str, Any] = {}
    for line in _sse_lines(url, body, "/v1/completions"):
        if not line.startswith("data:") or line[5:].strip() == "[DONE]":
            continue
        obj = json.loads(line[5:])
        usage = obj.get("usage") or usage
        for ch in obj.get("choices") or []:
            if ch.get("text"):
                last = time.perf_counter() - t0
                first = first or last
                n += 1
    return first, int(usage.get("completion_tokens", n)), last - first
