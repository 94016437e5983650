"""From a parsed request to prompt token ids: render, bound, tokenize once.

- Client text stays text: special-token texts it holds are tokenized without special
  parsing (``literals``), the template's markup with it.
- A prompt that cannot fit is refused before it is tokenized: one token covers at most
  ``max_token_bytes`` bytes, so a text of B bytes has at least B / max_token_bytes tokens.
- One tokenization per request. The engine keeps a replay checkpoint where the history
  ends (before the generation prompt): the prompt is tokenized in two parts cut where a
  special token starts at or before that point, which tokenizes exactly as the whole
  text does, and the first part's length is the history.
- Where other conversations may share the prompt and where the client asked to keep it
  (proxy/api/hints.py) are character offsets; each becomes the number of tokens that end
  at or before it (their bytes counted as the tokenizer writes them), so a point never
  lies past the text it names.

These functions block (tokenizing a long prompt takes a while): call them off the loop.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from proxy.api.chat import ChatRequest
from proxy.api.fields import ApiError
from proxy.api.hints import marks_to_place, place
from proxy.api.literals import AREA_RE, Literals
from proxy.api.prompt_memo import PromptMemo
from proxy.api.render import ChatTemplate, render_chat
from proxy.engine.tokens import Tokenizer

CONTEXT_CODE = "context_length_exceeded"


@dataclass(slots=True, frozen=True)
class Prompt:
    text: str  # as rendered (client text that holds special-token texts escaped)
    tokens: np.ndarray  # int32, read-only
    history: int | None  # tokens of the history before the generation prompt
    share_points: tuple[int, ...] = ()  # token positions (proxy/api/hints.py)
    breakpoints: tuple[tuple[int, float], ...] = ()  # (token position, seconds to keep)
    tools_json: str | None = None  # the tools' JSON where the memo had it (misses.py's)
    render_s: float = 0.0  # what each part took (the Done line, /admin/requests)
    tokenize_s: float = 0.0
    points_s: float = 0.0


def utf8_len(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def check_fits(n_bytes: int, max_token_bytes: int | None, n_ctx: int, asked: int | None,
               param: str) -> None:
    """Refuse a text that has more tokens than the context holds, without tokenizing it."""
    if not max_token_bytes:
        return
    least = n_bytes // max_token_bytes
    room = n_ctx - (asked or 1)
    if least > room:
        what = f"and max_tokens is {asked}" if asked else "which leaves no room for a reply"
        raise ApiError(f"this model's context is {n_ctx} tokens; the prompt is {n_bytes:,} "
                       f"bytes, so at least {least:,} tokens, {what}", param, CONTEXT_CODE)


def _history_cut(prompt: str, history: str, special_re: re.Pattern[str] | None) -> int | None:
    """An offset at or before the end of the history where the prompt may be cut without
    changing its tokens: the start of a special token or of a placeholder."""
    if not history or not prompt.startswith(history):
        return None
    h = len(history)
    starts = [m.start() for m in (AREA_RE.search(prompt, max(h - 1, 0), h + 1),
                                  special_re and special_re.match(prompt, h)) if m]
    if h in starts or h - 1 in starts:
        return h  # the generation prompt starts with a special token (ChatML, Gemma)
    last = -1
    for regex in (AREA_RE, special_re):
        for m in regex.finditer(prompt, 0, h) if regex is not None else ():
            last = max(last, m.start())
    return last if last >= 0 else None


def chat_prompt(tokenizer: Tokenizer, template: ChatTemplate, req: ChatRequest, tenant: str,
                n_ctx: int, memo: PromptMemo | None = None) -> Prompt:
    """``memo``: what earlier prompts showed (proxy/api/prompt_memo.py): then the
    history is not rendered again where its ending is known, and the first turn's marks
    are placed once per conversation."""
    t0 = time.perf_counter()
    table = Literals(tokenizer.special_re, tokenizer.special_json_re)
    tools_json = None
    if memo is not None and req.tools:
        tools, tools_json, clean = memo.tools(req.tools, tokenizer.special_json_re)
        req = dataclasses.replace(req, tools=tuple(tools))
        if clean:
            table.trust(req.tools)
    text = render_chat(template, req, escape=table.escape)
    check_fits(utf8_len(text), tokenizer.max_token_bytes, n_ctx, req.max_tokens,
               "messages")

    def render_history() -> str:
        history = render_chat(template, req, add_generation_prompt=False, escape=table.escape)
        if template.trailer and history.endswith(template.trailer):
            history = history[:-len(template.trailer)]  # the next turn's messages go there
        return history

    history = render_history() if memo is None else memo.history(
        req, text, render_history, _kwargs_key(req))
    t1 = time.perf_counter()
    cut = _history_cut(text, history, tokenizer.special_re)
    segments, at = table.segments(text, () if cut is None else (cut,))
    tokens, ends = tokenizer.tokenize_segments(segments, tenant)
    n_history = None
    if cut is not None:
        n_history = ends[at[0] - 1] if at[0] > 0 else 0
    t2 = time.perf_counter()
    share, keep = _points(tokenizer, template, req, text, tokens, table, memo)
    return Prompt(text, tokens, n_history or None, share, keep, render_s=t1 - t0,
                  tokenize_s=t2 - t1, points_s=time.perf_counter() - t2,
                  tools_json=tools_json)


def _kwargs_key(req: ChatRequest) -> str:
    return json.dumps(dict(req.template_kwargs), sort_keys=True, default=str)


def _points(tokenizer: Tokenizer, template: ChatTemplate, req: ChatRequest, text: str,
            tokens: np.ndarray, table: Literals, memo: PromptMemo | None = None
            ) -> tuple[tuple[int, ...], tuple[tuple[int, float], ...]]:
    """Share points and breakpoints as token positions (proxy/api/hints.py)."""
    marks = marks_to_place(req)
    if not marks:
        return (), ()

    def render(r: ChatRequest) -> str:
        return render_chat(template, r, escape=table.escape)

    def positions(chars: Sequence[int], anchor: tuple[int, int] = (0, 0)) -> list[int]:
        return _positions(tokenizer, tokens, text, table, chars, anchor)

    if memo is None:
        placed = place(render, req, text, marks)
        found = list(zip((m for m, _ in placed), positions([c for _, c in placed]),
                         strict=True))
    else:
        found = memo.points(render, req, text, marks, table.escape, tokenizer.special_re,
                            positions)
    share = sorted({n for m, n in found if m.ttl == 0 and n > 0})
    keep: dict[int, float] = {}
    for m, n in found:
        if m.ttl > 0 and n > 0:
            keep[n] = max(keep.get(n, 0.0), m.ttl)
    return tuple(share), tuple(sorted(keep.items()))


def _positions(tokenizer: Tokenizer, tokens: np.ndarray, text: str, table: Literals,
               chars: Sequence[int], anchor: tuple[int, int]) -> list[int]:
    """How many tokens end at or before each character offset of ``chars`` (their bytes
    as the tokenizer writes them), counted on from ``anchor``: a character offset and the
    tokens before it, known to be this prompt's (only the tokens after it are read)."""
    c0, t0 = anchor
    ends = np.cumsum(tokenizer.model.piece_lengths(tokens[t0:]), dtype=np.int64)
    return [t0 + int(np.searchsorted(ends, table.plain_bytes(text[c0:c]), side="right"))
            for c in chars]


def completion_prompt(tokenizer: Tokenizer, text: str, tenant: str, n_ctx: int,
                      asked: int | None) -> list[int]:
    """A raw prompt: the client writes the markup, so special-token texts parse."""
    check_fits(utf8_len(text), tokenizer.max_token_bytes, n_ctx, asked, "prompt")
    return tokenizer.tokenize_prompt(text, tenant)
