"""Stop strings cut exactly, wherever token boundaries fall: text that may start a stop is held back."""
from __future__ import annotations


class StopCutter:
    """Feed the answer's text piece by piece; get back only text that can never be part of a stop.

    A stop string may span several tokens (and several steps), so the tail of what was fed that is a
    prefix of some stop string waits until the next piece decides it. Once a stop string appears, the
    answer ends just before it and `stopped` is set.
    """

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.held = ""  # fed, not yet released: may be the start of a stop string
        self.stopped = False  # a stop string was found; nothing more is released

    def feed(self, piece: str) -> str:
        """Returns the text now safe to send (possibly "")."""
        if self.stopped:
            return ""
        text = self.held + piece
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self.held = True, ""
            return text[: min(hits)]
        keep = self._partial(text)
        self.held = text[len(text) - keep:] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """At the end of the answer: what was held back was not a stop after all."""
        text, self.held = ("" if self.stopped else self.held), ""
        return text

    def _partial(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best
