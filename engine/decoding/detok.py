"""Incremental detokenization that never emits half a character."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # any object with decode() will do (the llama.cpp runtime brings its own)
    from transformers import PreTrainedTokenizerBase

REPLACEMENT = "\ufffd"


class Detokenizer:
    """Feeds token ids one by one; returns only text that is complete.

    The window trick (as in vLLM / TGI): decode a short window of recent ids twice, with and without
    the new ones, and emit the difference once it no longer ends in U+FFFD. Decoding a window rather
    than everything keeps each push O(1); decoding with context keeps spaces and merges right.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_ids: list[int] | None = None) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_ids[-4:]) if prompt_ids else []
        self.prefix_offset = 0  # window start
        self.read_offset = len(self.ids)  # ids up to here have been emitted as text
        self._prefix: tuple[int, int, str] = (-1, -1, "")  # the window's emitted text, decoded once per window

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
        )

    def _emitted(self) -> str:
        """The window's text up to read_offset (pushes and peeks in one window decode it once)."""
        start, end, text = self._prefix
        if (start, end) != (self.prefix_offset, self.read_offset):
            text = self._decode(self.ids[self.prefix_offset : self.read_offset])
            self._prefix = (self.prefix_offset, self.read_offset, text)
        return text

    def push(self, token_id: int) -> str:
        """Adds one id; returns the newly completed text ("" while a character is incomplete)."""
        self.ids.append(token_id)
        prefix = self._emitted()
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith(REPLACEMENT):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return full[len(prefix) :]
        return ""

    def peek(self, token_id: int) -> str:
        """Text the id would add, without committing it (for rejected tokens); may be ""."""
        prefix = self._emitted()
        full = self._decode(self.ids[self.prefix_offset :] + [token_id])
        return full[len(prefix) :].rstrip(REPLACEMENT)

    def flush(self) -> str:
        """Whatever is still pending at the end (an incomplete character stays as U+FFFD)."""
        prefix = self._emitted()
        full = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix) :]
