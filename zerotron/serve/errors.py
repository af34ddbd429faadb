"""Client errors of ``zerotron serve`` and the request limits: :class:`RequestError`."""
from __future__ import annotations

__all__ = ["RequestError", "MAX_N", "MAX_STOP", "MAX_PROMPTS", "MAX_TOKENS"]

MAX_N, MAX_STOP, MAX_PROMPTS, MAX_TOKENS = 16, 4, 64, 4096


class RequestError(ValueError):
    """A client error: HTTP ``status``, ``param`` (the offending field or None), ``code``, message."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code
