"""Validation of ``/v1/completions`` bodies: :func:`parse_completion`, :class:`RequestError`."""
from __future__ import annotations

__all__ = ["RequestError", "parse_completion", "FIELDS", "MAX_N", "MAX_STOP", "MAX_PROMPTS", "MAX_TOKENS"]

MAX_N, MAX_STOP, MAX_PROMPTS, MAX_TOKENS = 16, 4, 64, 4096


class RequestError(ValueError):
    """A client error: HTTP ``status``, ``param`` (the offending field or None), message."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


def _num(body: dict, key: str, default, kind, lo=None, hi=None, lo_open=False):
    v = body.get(key, default)
    if v is None:
        return default
    ok = isinstance(v, kind) and not isinstance(v, bool)
    if ok and lo is not None:
        ok = v > lo if lo_open else v >= lo
    if ok and hi is not None:
        ok = v <= hi
    if ok and isinstance(v, float) and v != v:
        ok = False
    if not ok:
        rng = f" in {'(' if lo_open else '['}{lo}, {hi}]" if hi is not None else (f" >= {lo}" if lo is not None else "")
        raise RequestError(f"'{key}' must be {'a number' if kind is not int else 'an integer'}{rng}, got {v!r}",
                           param=key)
    return v


# the fields this server reads; OpenAI's other completion fields are accepted only at the value
# that changes nothing (what the openai package sends when a caller leaves them out)
FIELDS = ("model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "stop", "seed", "stream")
NEUTRAL = {"echo": (False,), "logprobs": (None,), "best_of": (None, 1), "suffix": (None, ""),
           "frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0), "logit_bias": (None, {})}
IGNORED = ("user",)  # an end-user id for the provider's logs: nothing to do here


def _check_fields(body: dict) -> None:
    for key, value in body.items():
        if key in FIELDS or key in IGNORED:
            continue
        if key in NEUTRAL:
            if any(value == v and type(value) is type(v) for v in NEUTRAL[key]):
                continue
            raise RequestError(f"'{key}' is not supported by this server (only {NEUTRAL[key][0]!r}); remove it",
                               param=key, code="unsupported_parameter")
        raise RequestError(f"unknown field {key!r}"[:200] + f"; valid fields: {', '.join(FIELDS + IGNORED)}",
                           param=str(key)[:100], code="unknown_parameter")


def parse_completion(body, model_id: str) -> dict:
    """Validate a /v1/completions JSON body; return ``{"prompts", "max_tokens", "temperature",
    "top_p", "top_k", "n", "stop", "seed", "stream"}``. Raises RequestError (400, or 404 for another
    model): an unknown field, or one of OpenAI's fields this server does not implement (``echo``,
    ``logprobs``, ``best_of``, ``suffix``, penalties, ``logit_bias``) at a value that would change
    the answer, is refused rather than ignored."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    _check_fields(body)
    if body.get("model") not in (None, model_id):
        raise RequestError(f"the model {body['model']!r} does not exist; this server serves {model_id!r}",
                           status=404, param="model", code="model_not_found")
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise RequestError(f"'stream' must be true or false, got {stream!r}", param="stream")
    prompt = body.get("prompt")
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not isinstance(prompts, list) or not prompts or len(prompts) > MAX_PROMPTS or \
            not all(isinstance(p, str) and p for p in prompts):
        raise RequestError(f"'prompt' is required: a non-empty string or a list of 1..{MAX_PROMPTS} non-empty "
                           f"strings, got {prompt!r}"[:300], param="prompt")
    stop = body.get("stop")
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > MAX_STOP or not all(isinstance(s, str) and s for s in stops):
        raise RequestError(f"'stop' must be a non-empty string or a list of at most {MAX_STOP}, got {stop!r}",
                           param="stop")
    for key, texts in (("prompt", prompts), ("stop", stops)):
        for t in texts:
            try:  # JSON may carry lone surrogates ("\ud800"): not text the tokenizer can take
                t.encode("utf-8")
            except UnicodeEncodeError as e:
                raise RequestError(f"'{key}' must be valid Unicode text: {e.reason} at position {e.start}",
                                   param=key) from None
    top_k = body.get("top_k")
    if top_k is not None:
        top_k = _num(body, "top_k", None, int, lo=1)
    return {"prompts": prompts, "stop": stops, "top_k": top_k, "stream": bool(stream),
            "max_tokens": _num(body, "max_tokens", 16, int, lo=0, hi=MAX_TOKENS),
            "temperature": _num(body, "temperature", 1.0, (int, float), lo=0, hi=100),
            "top_p": _num(body, "top_p", 1.0, (int, float), lo=0, hi=1, lo_open=True),
            "n": _num(body, "n", 1, int, lo=1, hi=MAX_N), "seed": _num(body, "seed", 0, int, lo=0, hi=2**63 - 1)}
