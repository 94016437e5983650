"""Recent responses, for the Responses API's ``previous_response_id``."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from proxy.api.chat import ChatMessage
from proxy.api.fields import ApiError


@dataclass(slots=True, frozen=True)
class _Stored:
    tenant: str
    parent: str | None
    messages: tuple[ChatMessage, ...]  # this response's input and output
    chars: int


def _chars(messages: tuple[ChatMessage, ...]) -> int:
    return sum(len(m.content or "") + len(m.reasoning_content or "")
               + sum(len(c.arguments) for c in m.tool_calls) for m in messages)


class ResponseStore:
    """Recent responses for ``previous_response_id``: each keeps only its own input and
    output and points at its parent. Bounded by count and characters; the least
    recently used goes first, and reading a response touches its whole chain."""

    def __init__(self, max_responses: int = 1024, max_chars: int = 64 * 1024 * 1024) -> None:
        self._max_responses, self._max_chars = max_responses, max_chars
        self._items: OrderedDict[str, _Stored] = OrderedDict()
        self._chars = 0

    def __len__(self) -> int:
        return len(self._items)

    def history(self, response_id: str, tenant: str) -> tuple[ChatMessage, ...]:
        """The conversation up to and including that response; ValueError if unknown."""
        chain: list[tuple[ChatMessage, ...]] = []
        at: str | None = response_id
        while at is not None:
            item = self._items.get(at)
            if item is None or item.tenant != tenant:
                raise ApiError(f"previous response {at!r} is not found: this server keeps "
                               f"the last {self._max_responses} responses in memory, and "
                               "only those stored with 'store': true",
                               "previous_response_id")
            self._items.move_to_end(at)
            chain.append(item.messages)
            at = item.parent
        return tuple(m for part in reversed(chain) for m in part)

    def put(self, response_id: str, tenant: str, parent: str | None,
            messages: tuple[ChatMessage, ...]) -> None:
        item = _Stored(tenant, parent, messages, _chars(messages))
        self._items[response_id] = item
        self._chars += item.chars
        while self._items and (len(self._items) > self._max_responses
                               or self._chars > self._max_chars):
            _, old = self._items.popitem(last=False)
            self._chars -= old.chars
