"""Turning generated token bytes into text deltas: whole UTF-8 characters, stop strings."""

from __future__ import annotations

import codecs


class TextStream:
    """Feeds token bytes, yields text that is safe to send.

    Holds back an incomplete UTF-8 sequence and any tail that could be the start of
    a stop string; ``stopped`` turns true once a stop string is seen (the stop string
    and what follows are never emitted).
    """

    def __init__(self, stops: tuple[str, ...] = ()) -> None:
        self._dec = codecs.getincrementaldecoder("utf-8")("replace")
        self._stops = tuple(s for s in stops if s)
        self._held = ""
        self._partial = False  # the decoder holds the first bytes of a character
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    def feed(self, data: bytes) -> str:
        if self.stopped:
            return ""
        if self._partial:
            text = self._dec.decode(data)
            self._partial = bool(self._dec.getstate()[0])
        else:
            try:  # whole characters, most tokens: as the incremental decoder would
                text = data.decode()
            except UnicodeDecodeError:
                text = self._dec.decode(data)
                self._partial = bool(self._dec.getstate()[0])
        if not self._stops:
            return text
        self._held += text
        return self._release(final=False)

    def finish(self) -> str:
        if self.stopped:
            return ""
        self._held += self._dec.decode(b"", final=True)
        return self._release(final=True)

    def _release(self, *, final: bool) -> str:
        text = self._held
        found = [(i, stop) for stop in self._stops if (i := text.find(stop)) >= 0]
        if found:
            i, self.matched = min(found, key=lambda f: f[0])  # the earliest in the text
            self.stopped = True
            self._held = ""
            return text[:i]
        if final or not self._stops:
            self._held = ""
            return text
        keep = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:k]):
                    keep = max(keep, k)
                    break
        self._held = text[len(text) - keep:]
        return text[: len(text) - keep]
