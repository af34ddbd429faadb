"""Stop strings and streamed text: :func:`cut_at_stop`, :class:`StreamText`."""
from __future__ import annotations

__all__ = ["cut_at_stop", "StreamText"]


def cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """``text`` up to (excluding) the earliest stop string; whether one was found."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


def _held_back(text: str, stops: list[str]) -> str:
    """``text`` minus what the next tokens may still change: a trailing incomplete UTF-8 character
    (decoded as U+FFFD) and the longest suffix that is a prefix of a stop string."""
    text = text.rstrip("\ufffd")
    for k in range(min(len(text), max((len(x) for x in stops), default=1) - 1), 0, -1):
        if any(x.startswith(text[-k:]) for x in stops):
            return text[:-k]
    return text


class StreamText:
    """The text of one streamed choice: :meth:`push` each new token id, get the new piece to send
    ("" while held back, see :func:`_held_back`); :meth:`finish` returns the rest. The pieces
    concatenate to ``cut_at_stop(decode(tokens), stops)[0]``, the non-streamed text.

    ``step`` (optional): an incremental decoder, token id -> the text it completes or None (a
    ``tokenizers.decoders.DecodeStream`` bound to the tokenizer); then a push costs O(1) decoding
    instead of decoding every token so far (O(n) per token, O(n^2) per choice). :meth:`finish`
    decodes all tokens at once either way, so the last piece makes the sum exact."""

    def __init__(self, decode, stops: list[str], step=None):
        self.decode, self.stops, self.tokens, self.sent = decode, stops, [], ""
        self.step, self.text = step, ""

    def push(self, token: int) -> str:
        self.tokens.append(token)
        if self.step is not None:
            self.text += self.step(token) or ""
            full = self.text
        else:
            full = self.decode(self.tokens)
        text, found = cut_at_stop(full, self.stops)
        return self._piece(text if found else _held_back(text, self.stops))

    def finish(self) -> str:
        return self._piece(cut_at_stop(self.decode(self.tokens), self.stops)[0])

    def _piece(self, text: str) -> str:
        if not text.startswith(self.sent):  # the decoder rewrote earlier text: wait for the end
            return ""
        piece, self.sent = text[len(self.sent):], text
        return piece
