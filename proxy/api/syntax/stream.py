"""The one parser of replies: text in, reasoning, content and whole tool calls out.

``BlockParser`` runs any ``Syntax`` of blocks (proxy/api/syntax/calls.py). It is fed
text deltas, as the engine decodes them, and finished once; ``parse`` feeds it a whole
reply. Both go through the same steps, so streaming and non-streaming agree for every
split of the text.

- Reasoning: a reply that starts (past whitespace) with a reasoning opener, or whose
  prompt left it inside one (``starts_in_reasoning``), is reasoning until the closer;
  an unclosed block is reasoning to the end. Reasoning is trimmed at both ends.
- Content: text as written, less whitespace at its very start and end. Text that could
  be the start of a block's opener is held back until the next delta decides it, so no
  fragment of call syntax reaches content.
- Calls: a block's text is gathered whole, up to the first closer after which its body
  reads as calls (a closer inside a JSON string or a parameter's value does not end
  it), then read by the family's ``Body``. A call goes out whole (id, name, arguments)
  once its block has closed; a block that does not read as calls goes to content as
  written, with a warning. A block that only the family's lenient reader reads (a
  closer left out) waits for the reply's end, in case a later closer is the real one.
  At the end of a reply that a stop token ended, an unclosed block is read as it
  stands (an opener with nothing after it is dropped); in one the token limit cut
  (``finish(cut=True)``) only the calls written whole before the cut are kept and the
  rest of the block is dropped: a call the model never finished is never returned,
  and no fragment of its syntax reaches content (canitoolcall's spec).
- A block opener inside reasoning that the prompt opened: held back; when the reply
  ends with the reasoning never closed and that text reads as calls, they are calls
  (Qwen3.5 starts a call without closing the ``<think>`` its prompt opened), else it
  was reasoning.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from proxy.api.syntax.calls import (
    Block,
    Delta,
    RawCall,
    Syntax,
    Tools,
    leading_calls,
    new_call_id,
    to_parsed,
)

log = logging.getLogger(__name__)


def partial_len(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest end of ``text`` that is a proper start of one of ``tags``."""
    best = 0
    for tag in tags:
        for k in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:k]):
                best = k
                break
    return best


class BlockParser:
    """Incremental parser: ``feed`` text deltas, then ``finish`` once."""

    def __init__(self, syntax: Syntax, *, starts_in_reasoning: bool = False,
                 parse_tools: bool = True, tools: Tools | None = None,
                 make_id: Callable[[], str] = new_call_id, quiet: bool = False) -> None:
        self.syntax = syntax
        self._quiet = quiet
        self._tools = tools
        self._make_id = make_id
        self._blocks = syntax.blocks if parse_tools else ()
        self._buf = ""
        self._mode = "start"  # start | reasoning | content | block | done
        # what ends the reasoning: the closers of the pairs that share its opener
        self._closes = self._closers(syntax.reasoning[0][0]) if syntax.reasoning else ()
        if starts_in_reasoning and syntax.reasoning:
            self._mode = "reasoning"
        self._block: Block | None = None
        self._tried = 0  # where in a block's text the next closer is looked for
        self._failed = -1  # the first closer after which the block did not read
        self._loose: tuple[int, list[RawCall]] | None = None  # (closer, calls) read leniently
        self._in_reasoning = starts_in_reasoning and bool(syntax.reasoning)
        self._lead = True  # nothing but whitespace emitted in this segment yet
        self._content_seen = False  # content has begun (Llama 3's bare JSON: not at start)
        self._held_ws = ""  # content's trailing whitespace, out once more text follows
        self._markers = tuple(b.open for b in self._blocks) + syntax.drop

    # -- the interface --------------------------------------------------------------

    def feed(self, text: str) -> Delta:
        self._buf += text
        out = Delta()
        while self._step(out, final=False):
            pass
        return out

    def finish(self, cut: bool = False) -> Delta:
        out = Delta()
        while True:
            while self._step(out, final=True):
                pass
            if self._mode != "block":
                break
            self._end_block(out, cut)
        rest, self._buf = self._buf, ""
        if self._mode == "reasoning":
            self._end_reasoning(out, rest, cut)
        elif rest:
            self._content(out, rest, final=True)
        self._mode = "done"
        return out

    # -- steps ----------------------------------------------------------------------

    def _step(self, out: Delta, final: bool) -> bool:
        if self._mode == "start":
            return self._start(final)
        if self._mode == "reasoning":
            return self._reasoning(out, final)
        if self._mode == "content":
            return self._content_step(out, final)
        if self._mode == "block":
            return self._block_step(out)
        return False

    def _start(self, final: bool) -> bool:
        stripped = self._buf.lstrip()
        for open_, _ in self.syntax.reasoning:
            if stripped.startswith(open_):
                self._buf, self._closes = stripped[len(open_):], self._closers(open_)
                self._mode, self._lead = "reasoning", True
                return True
        if not final and any(o.startswith(stripped) for o, _ in self.syntax.reasoning):
            return False  # empty, or a partial opener: wait
        self._mode = "content"
        return True

    def _closers(self, opener: str) -> tuple[str, ...]:
        return tuple(c for o, c in self.syntax.reasoning if o == opener)

    def _trim_reasoning(self, text: str, final: bool) -> str:
        if self._lead:
            text = text.lstrip()
            if not text:
                return ""
            self._lead = False
        if final:
            return text.rstrip()
        body = text.rstrip()
        self._buf = text[len(body):] + self._buf  # trailing whitespace waits
        return body

    def _reasoning(self, out: Delta, final: bool) -> bool:
        buf = self._buf
        found = [(i, c) for i, c in ((buf.find(c), c) for c in self._closes) if i >= 0]
        if found:
            pos, close = min(found)
            self._buf = ""
            out.reasoning += self._trim_reasoning(buf[:pos], final=True)
            self._buf = buf[pos + len(close):]
            self._mode, self._lead, self._in_reasoning = "content", True, False
            return True
        if final:
            return False
        hold = partial_len(buf, self._closes)
        if self._in_reasoning:  # text from a block opener on waits for the closer
            opened = [i for i in (buf.find(b.open) for b in self._blocks if not b.at_start)
                      if i >= 0]
            hold = len(buf) - min(opened) if opened else max(
                hold, partial_len(buf, tuple(b.open for b in self._blocks)))
        self._buf = ""
        out.reasoning += self._trim_reasoning(buf[:len(buf) - hold], final=False)
        self._buf += buf[len(buf) - hold:]
        return False

    def _end_reasoning(self, out: Delta, rest: str, cut: bool) -> None:
        """Reasoning the reply never closed: calls where it ends in a block of them."""
        if self._in_reasoning and any(rest.lstrip().startswith(b.open) for b in self._blocks
                                      if not b.at_start):
            sub = BlockParser(self.syntax, tools=self._tools, make_id=self._make_id,
                              quiet=True)
            got = sub.feed(rest)
            got.extend(sub.finish(cut))
            if got.tool_calls:
                out.extend(got)
                return
        out.reasoning += self._trim_reasoning(rest, final=True)

    def _content(self, out: Delta, text: str, final: bool) -> None:
        """Emit content: whitespace at the very start dropped, trailing whitespace held."""
        if self._lead:
            text = text.lstrip()
            if not text:
                return
            self._lead = False
        text = self._held_ws + text
        body = text.rstrip()
        self._held_ws = "" if final else text[len(body):]
        if body:
            out.content += body
            self._content_seen = True

    def _opener(self, buf: str) -> tuple[int, Block | None, str]:
        """The first block opener or dropped marker in ``buf``: (position, block, text)."""
        best: tuple[int, Block | None, str] = (-1, None, "")
        for b in self._blocks:
            if b.at_start:
                if self._content_seen:
                    continue
                at = len(buf) - len(buf.lstrip())
                pos = at if buf.startswith(b.open, at) else -1
            else:
                pos = buf.find(b.open)
            if pos >= 0 and (best[0] < 0 or pos < best[0]):
                best = (pos, b, b.open)
        for marker in self.syntax.drop:
            pos = buf.find(marker)
            if pos >= 0 and (best[0] < 0 or pos < best[0]):
                best = (pos, None, marker)
        return best

    def _content_step(self, out: Delta, final: bool) -> bool:
        buf = self._buf
        if not self._markers:
            self._buf = ""
            self._content(out, buf, final=False)
            return False
        pos, block, marker = self._opener(buf)
        if pos >= 0:
            self._content(out, buf[:pos], final=False)
            rest = buf[pos + len(marker):]
            if block is None:  # a stray marker: dropped
                self._buf = rest
                return True
            self._block, self._tried, self._failed, self._loose = block, 0, -1, None
            self._buf = (marker + rest) if block.keep_open else rest
            self._mode = "block"
            return True
        hold = 0 if final else partial_len(buf, self._markers)
        if not final and not self._content_seen and any(b.at_start for b in self._blocks):
            stripped = buf.lstrip()
            if not stripped:
                return False  # the reply may yet open with a bare call
        self._buf = buf[len(buf) - hold:] if hold else ""
        self._content(out, buf[:len(buf) - hold], final=False)
        return False

    def _block_step(self, out: Delta) -> bool:
        block = self._block
        assert block is not None
        if block.close is None:
            return False  # to the reply's end
        buf = self._buf
        while True:
            pos = buf.find(block.close, self._tried)
            if pos < 0:
                self._tried = max(self._tried, len(buf) - len(block.close) + 1, 0)
                return False
            if self._failed >= 0 and block.open in buf[self._failed:pos]:
                # a new block opened after the first closer: this one ended there
                self._settle(out)
                return True
            calls = block.body(buf[:pos], self._tools)
            if calls is not None:
                self._emit_calls(out, calls, pos + len(block.close))
                return True
            if self._failed < 0:
                self._failed = pos
            if self._loose is None and block.loose is not None:
                loose = block.loose(buf[:pos], self._tools)
                if loose is not None:
                    self._loose = (pos + len(block.close), loose)
            self._tried = pos + 1

    def _emit_calls(self, out: Delta, calls: list[RawCall], end: int) -> None:
        """The block's calls, and the text after ``end`` back to content."""
        out.tool_calls.extend(to_parsed(calls, self._make_id))
        self._buf = self._buf[end:]
        self._mode, self._block, self._loose = "content", None, None

    def _settle(self, out: Delta) -> None:
        """A block whose body never read at a closer: its lenient reading, else content."""
        if self._loose is not None:
            end, calls = self._loose
            self._emit_calls(out, calls, end)
            return
        block = self._block
        assert block is not None and block.close is not None
        self._malformed(out, self._failed + len(block.close))

    def _malformed(self, out: Delta, end: int) -> None:
        """The block's text up to ``end`` goes to content as written."""
        block = self._block
        assert block is not None
        text, self._buf = self._buf[:end], self._buf[end:]
        if not self._quiet:
            log.warning("a %s tool-call block did not parse; returned as content",
                        self.syntax.name)
        self._mode, self._block, self._loose = "content", None, None
        self._content(out, text if block.keep_open else block.open + text, final=False)

    def _end_block(self, out: Delta, cut: bool) -> None:
        """A block still open at the reply's end: its calls as it stands, or those written
        whole before the token limit cut it (the rest dropped)."""
        block = self._block
        assert block is not None
        text = self._buf
        calls = None if cut else block.body(text, self._tools)
        if calls is not None:
            self._emit_calls(out, calls, len(text))
            return
        if self._loose is not None:
            self._settle(out)
            return
        if cut or not text.strip() or (block.keep_open and text == block.open):
            kept = leading_calls(block.body, text, self._tools) if cut else []
            self._emit_calls(out, kept, len(text))
            return
        loose = block.loose(text, self._tools) if block.loose is not None else None
        if loose is not None:
            self._emit_calls(out, loose, len(text))
            return
        if not self._quiet:
            log.warning("a %s tool-call block did not parse; returned as content",
                        self.syntax.name)
        self._buf = ""
        self._mode, self._block = "content", None
        written = text if block.keep_open else block.open + text
        self._lead = self._lead and not self._content_seen
        self._content(out, written, final=True)


def parse(syntax: Syntax, text: str, *, starts_in_reasoning: bool = False,
          parse_tools: bool = True, tools: Tools | None = None, cut: bool = False,
          make_id: Callable[[], str] = new_call_id, quiet: bool = False) -> Delta:
    """A whole reply at once (``quiet``: no warning for a block that does not parse)."""
    p = syntax.parser or BlockParser
    parser = p(syntax, starts_in_reasoning=starts_in_reasoning, parse_tools=parse_tools,
               tools=tools, make_id=make_id, quiet=quiet)
    out: Delta = parser.feed(text)
    out.extend(parser.finish(cut))
    return out
