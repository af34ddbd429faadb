"""Request errors and the validated form of a ``/v1/completions`` body: :class:`RequestError`,
:func:`parse_completion` (the checks themselves are the pydantic models of
:mod:`zerotron.serve.schemas`)."""
from __future__ import annotations

import secrets

__all__ = ["RequestError", "parse_completion", "MAX_N", "MAX_STOP", "MAX_PROMPTS", "MAX_TOKENS"]

from .errors import MAX_N, MAX_PROMPTS, MAX_STOP, MAX_TOKENS, RequestError
from .schemas import CompletionRequest, validate


def check_model(requested: str | None, model_id: str) -> None:
    """Raise RequestError 404 (param "model") if ``requested`` is given and is not ``model_id``."""
    if requested not in (None, model_id):
        raise RequestError(f"the model {requested!r} does not exist; this server serves {model_id!r}",
                           status=404, param="model", code="model_not_found")


def sampling(req) -> dict:
    """The sampling settings of a validated request (``schemas.CompletionRequest`` or
    ``ChatRequest``) with OpenAI's defaults filled in: ``{"max_tokens" (16 for completions, the
    context for chat: see :func:`zerotron.serve.api.Front.submit`), "temperature" (1.0), "top_p"
    (1.0), "top_k" (None), "n" (1), "stop" (list), "seed", "stream" (False), "include_usage"}``.
    ``seed``: the request's, else a fresh random one (62 bits), so that sampled requests without a
    seed differ from each other as in OpenAI's API and vLLM (a fixed default would answer every
    unseeded request alike). ``stream_options`` without ``stream`` true never reaches here: the
    schema refuses it (400, as OpenAI's API and vLLM)."""
    max_tokens = req.max_tokens
    if getattr(req, "max_completion_tokens", None) is not None:
        if max_tokens is not None and max_tokens != req.max_completion_tokens:
            raise RequestError("give 'max_tokens' or 'max_completion_tokens', not both", param="max_tokens")
        max_tokens = req.max_completion_tokens
    return {"max_tokens": max_tokens, "temperature": 1.0 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None else req.top_p, "top_k": req.top_k,
            "n": req.n or 1, "stop": req.stops(), "seed": secrets.randbits(62) if req.seed is None else req.seed, "stream": bool(req.stream),
            "include_usage": bool(req.stream_options and req.stream_options.include_usage)}


def parse_completion(body, model_id: str) -> dict:
    """Validate a /v1/completions JSON body; return ``{"prompts", "max_tokens" (default 16),
    "temperature", "top_p", "top_k", "n", "stop", "seed", "stream", "include_usage"}``. Raises
    RequestError (400 naming the field, or 404 for another model)."""
    req = validate(CompletionRequest, body)
    check_model(req.model, model_id)
    c = sampling(req)
    if c["max_tokens"] is None:
        c["max_tokens"] = 16  # OpenAI's default for completions
    return {"prompts": req.prompts(), **c}
