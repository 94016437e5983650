"""A budget of reasoning tokens, as llama-server's ``--reasoning-budget`` keeps one: once
the reply has spent the budget inside its reasoning block, the family's closer is forced,
token by token, and the reply goes on from there as the model writes it.

States, watched on the text the tokens decode to (a closer or opener the model writes
character by character counts as much as one written as a special token):
idle (outside reasoning) -> counting (inside: each token spends one) -> forcing (the
closer's tokens, in order) -> done; a new opener counts again, from the whole budget.
At the budget the closer waits for a character cut across byte tokens to complete, so
the reasoning stays valid UTF-8. A forced token the request's grammar refuses ends the
forcing (the grammar decides, as it would for any token).
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence


class ReasoningBudget:
    def __init__(self, budget: int, tags: tuple[str, str], forced: Sequence[int],
                 inside: bool) -> None:
        self.budget = budget
        self.open, self.close = tags
        self.forced = list(forced)
        self.state = "idle"
        self.remaining = budget
        self._at = 0  # the next forced token
        self._tail = ""  # the end of the text so far, to find the tags in
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self.spent = 0  # tokens the reply spent inside reasoning
        if inside:
            self._enter()

    def _enter(self) -> None:
        self.state, self.remaining, self._at = "counting", self.budget, 0
        if self.budget <= 0:
            self.state = "forcing"

    def next_forced(self) -> int | None:
        """The token the reply must take next, if the budget is spent."""
        if self.state == "forcing" and self._at < len(self.forced):
            return self.forced[self._at]
        return None

    def refused(self) -> None:
        """The grammar refused the forced token: the model goes on its own."""
        self.state = "done"

    def accept(self, token: int, piece: bytes) -> None:
        """The token the reply took, and its bytes."""
        text = self._utf8.decode(piece)
        whole = not self._utf8.getstate()[0]  # no byte of a character pending
        self._tail = (self._tail + text)[-(len(self.open) + len(self.close) + 8):]
        if self.state == "forcing":
            self._at += 1
            if self._at >= len(self.forced):
                self.state, self._tail = "done", ""
            return
        if self.state == "counting":
            self.spent += 1
            if self._tail.endswith(self.close):
                self.state, self._tail = "done", ""
                return
            self.remaining -= 1
            if self.remaining <= 0 and whole:
                self.state, self._at = "forcing", 0
            return
        if self._tail.endswith(self.open):  # idle or done: the model opens its reasoning
            self._tail = ""
            self._enter()
