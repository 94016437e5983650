"""Split generated text into OpenAI's reasoning_content, content and tool_calls.

Conventions (Qwen3 / Hermes style, which the ChatML and Gemma templates here write):
- ``<think>…</think>`` at the start of the reply is reasoning. When the prompt
  itself opened ``<think>`` (``starts_in_reasoning``), the reply starts inside the
  block and only ``</think>`` appears. ``<think>`` later in the reply is text.
- ``<tool_call>{"name": …, "arguments": {…}}</tool_call>`` blocks are tool calls
  (only when the request offers tools); a block that is not such JSON, or is never
  closed, stays in the content verbatim.
- Whitespace next to the tags and at both ends is dropped.

``StreamParser`` is the one implementation; ``parse_reply`` feeds it the whole
text, so streaming and non-streaming agree for any split of the text.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


def starts_in_reasoning(prompt: str) -> bool:
    """Whether the rendered prompt ends inside an unclosed ``<think>`` block."""
    return prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass(slots=True, frozen=True)
class ParsedToolCall:
    id: str
    name: str
    arguments: str  # JSON text

    def to_json(self) -> dict[str, object]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(slots=True)
class Delta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ParsedToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)

    def extend(self, other: Delta) -> None:
        self.reasoning += other.reasoning
        self.content += other.content
        self.tool_calls.extend(other.tool_calls)


def _tool_call(body: str, make_id: Callable[[], str]) -> ParsedToolCall | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            json.loads(args)  # already JSON text: keep it as written
        except ValueError:
            return None
    else:
        args = json.dumps(args, ensure_ascii=False)
    return ParsedToolCall(id=make_id(), name=obj["name"], arguments=args)


def _partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that could begin ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class StreamParser:
    """Incremental parser: ``feed`` text deltas, then ``finish`` once.

    Text that could be the start of a tag, and trailing whitespace, is held back
    until the next delta decides it, so a tag split across tokens never leaks.
    """

    def __init__(self, *, starts_in_reasoning: bool = False, parse_tools: bool = True,
                 make_id: Callable[[], str] = new_call_id) -> None:
        # start: before any output, <think> may open | reasoning | content | tool
        self._mode = "reasoning" if starts_in_reasoning else "start"
        self._parse_tools = parse_tools
        self._make_id = make_id
        self._buf = ""
        self._seg_start = True  # drop whitespace at the start of a segment

    def feed(self, text: str) -> Delta:
        self._buf += text
        out = Delta()
        while self._step(out):
            pass
        return out

    def finish(self) -> Delta:
        out = self.feed("")
        rest, self._buf = self._buf, ""
        if self._mode == "tool":
            self._emit(out, "content", CALL_OPEN + rest, final=True)
        elif self._mode == "reasoning":
            self._emit(out, "reasoning", rest, final=True)
        else:
            self._emit(out, "content", rest, final=True)
        self._mode = "done"
        return out

    def _emit(self, out: Delta, kind: str, text: str, final: bool) -> None:
        """Emit text of a segment; unless ``final``, keep its trailing whitespace back."""
        if self._seg_start:
            text = text.lstrip()
            if not text:
                return
            self._seg_start = False
        keep = "" if final else text[len(text.rstrip()):]
        text = text.rstrip()
        if kind == "reasoning":
            out.reasoning += text
        else:
            out.content += text
        self._buf = keep + self._buf

    def _step(self, out: Delta) -> bool:
        """Consume what the buffer decides; True if another step may make progress."""
        buf = self._buf
        if self._mode == "start":
            stripped = buf.lstrip()
            if stripped.startswith(THINK_OPEN):
                self._buf = stripped[len(THINK_OPEN):]
                self._mode, self._seg_start = "reasoning", True
                return True
            if THINK_OPEN.startswith(stripped):
                return False  # empty, or a partial "<think>": wait
            self._mode = "content"
            return True
        if self._mode == "tool":
            end = buf.find(CALL_CLOSE)
            if end < 0:
                return False
            call = _tool_call(buf[:end], self._make_id)
            self._buf = buf[end + len(CALL_CLOSE):]
            if call is not None:
                out.tool_calls.append(call)
            else:
                out.content += CALL_OPEN + buf[:end] + CALL_CLOSE
            self._mode, self._seg_start = "content", True
            return True
        if self._mode == "reasoning":
            tag, kind, nxt = THINK_CLOSE, "reasoning", "content"
        elif self._mode == "content" and self._parse_tools:
            tag, kind, nxt = CALL_OPEN, "content", "tool"
        else:  # content without tools, or done
            self._buf = ""
            self._emit(out, "content", buf, final=False)
            return False
        pos = buf.find(tag)
        if pos >= 0:
            self._buf = buf[pos + len(tag):]
            self._emit(out, kind, buf[:pos], final=True)
            self._mode, self._seg_start = nxt, True
            return True
        hold = _partial_tag_len(buf, tag)
        self._buf = buf[len(buf) - hold:] if hold else ""
        self._emit(out, kind, buf[:len(buf) - hold], final=False)
        return False


def parse_reply(text: str, *, starts_in_reasoning: bool = False,
                parse_tools: bool = True) -> Delta:
    """The whole reply at once: reasoning, content and tool calls."""
    p = StreamParser(starts_in_reasoning=starts_in_reasoning, parse_tools=parse_tools)
    out = p.feed(text)
    out.extend(p.finish())
    return out
