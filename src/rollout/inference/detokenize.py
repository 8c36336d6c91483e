"""Incremental detokenization with stop strings, for streaming and stop-string checks.

A byte-level BPE token can end in the middle of a UTF-8 character, and a
stop string can span several tokens, so text is released in two stages:
`push` decodes only a short window of recent tokens (like vLLM's
`detokenize_incrementally`) and holds back a trailing partial character; the
caller then holds back the last `longest stop - 1` characters until they can
no longer start a stop string.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class IncrementalText:
    """The decoded text of a growing token list, and the stop string it ran into, if any."""

    def __init__(self, tokenizer: Any, stop: Sequence[str]) -> None:
        self._tokenizer = tokenizer
        self._stop = tuple(stop)
        self._holdback = max((len(s) for s in self._stop), default=1) - 1
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._searched = 0  # text before this index holds no stop string
        self._emitted = 0
        self.text = ""
        self.stopped = False

    def push(self, token_id: int) -> None:
        """Add one token; sets `stopped` (and cuts `text`) when a stop string appears."""
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix) :]
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            self._find_stop()

    def finish(self) -> None:
        """Release whatever is still held back (a trailing partial character decodes to U+FFFD)."""
        if self.stopped:
            return
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) > len(prefix):
            self.text += full[len(prefix) :]
            self._read_offset = len(self._ids)
            self._find_stop()

    def take_new_text(self, *, final: bool) -> str:
        """Text not yet handed out that can no longer turn into a stop string (all of it when final)."""
        end = len(self.text) if final or self.stopped else max(self._emitted, len(self.text) - self._holdback)
        new, self._emitted = self.text[self._emitted : end], end
        return new

    def _find_stop(self) -> None:
        if not self._stop:
            return
        start = max(0, self._searched - self._holdback)
        hits = [i for i in (self.text.find(s, start) for s in self._stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True
        self._searched = len(self.text)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True) if ids else ""
