"""Pydantic models of the OpenAI request and response bodies ``zerotron serve`` speaks
(https://platform.openai.com/docs/api-reference/completions and .../chat), and
:func:`validate`, which turns a pydantic ``ValidationError`` into one 400
:class:`~zerotron.serve.errors.RequestError` naming the first offending field.

Requests are strict: an unknown field is refused (``code`` "unknown_parameter"), and OpenAI
fields this server does not implement (``echo``, ``logprobs``, ``best_of``, ``suffix``, the
penalties, ``logit_bias``; for chat also ``top_logprobs``, ``tools``, ``response_format`` other
than text) are accepted only at the value that changes nothing (what the ``openai`` package sends
when a caller leaves them out), else refused with ``code`` "unsupported_parameter". Numbers are
strict JSON numbers (``true`` is not 1). ``top_k`` is zerotron's extension (the openai client
sends it through ``extra_body``)."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import PydanticCustomError

from .errors import MAX_N, MAX_PROMPTS, MAX_STOP, RequestError

__all__ = ["CompletionRequest", "ChatRequest", "ChatMessage", "StreamOptions", "Usage", "CompletionChoice",
           "Completion", "ChatChoice", "ChatCompletion", "ChatDelta", "ChatChunkChoice", "ChatChunk", "ErrorBody",
           "ErrorResponse", "validate"]

Int = Annotated[int, Field(strict=True)]
TokenIds = Annotated[list[Annotated[int, Field(strict=True, ge=0)]], Field(min_length=1)]
Num = Annotated[float, Field(strict=True, allow_inf_nan=False)]
Text = Annotated[str, Field(min_length=1)]


def _unicode(text: str, field: str) -> str:
    try:  # JSON may carry lone surrogates ("\ud800"): not text the tokenizer can take
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise PydanticCustomError("unicode", "'{field}' must be valid Unicode text: {why} at position {pos}",
                                  {"field": field, "why": e.reason, "pos": e.start}) from None
    return text


def _neutral(field: str, value, allowed: tuple) -> Any:
    if any(value == v and type(value) is type(v) for v in allowed):
        return value
    raise PydanticCustomError("unsupported_parameter",
                              "'{field}' is not supported by this server (only {only}); remove it",
                              {"field": field, "only": repr(allowed[0])})


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a last chunk with ``usage`` and no choices."""

    model_config = ConfigDict(extra="forbid")
    include_usage: Annotated[bool, Field(strict=True)] | None = None


class _Sampling(BaseModel):
    """The sampling fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: Annotated[int, Field(strict=True, ge=0)] | None = None  # the bound: api.max_new_tokens
    temperature: Annotated[float, Field(strict=True, ge=0, le=100, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(strict=True, gt=0, le=1, allow_inf_nan=False)] | None = None
    top_k: Annotated[int, Field(strict=True, ge=1)] | None = None
    n: Annotated[int, Field(strict=True, ge=1, le=MAX_N)] | None = None
    stop: Text | Annotated[list[Text], Field(max_length=MAX_STOP)] | None = None
    seed: Annotated[int, Field(strict=True, ge=0, le=2**63 - 1)] | None = None
    stream: Annotated[bool, Field(strict=True)] | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id for the provider's logs: nothing to do here
    frequency_penalty: Any = None
    presence_penalty: Any = None
    logit_bias: Any = None

    @field_validator("stop")
    @classmethod
    def _stop_text(cls, v):
        for s in [v] if isinstance(v, str) else v or []:
            _unicode(s, "stop")
        return v

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, v, info):
        # OpenAI's API answers 400 (param 'stream_options', code null) with this message; null is allowed
        if v is not None and info.data.get("stream") is not True:
            raise PydanticCustomError("only_when_streaming", "The 'stream_options' parameter is only allowed when "
                                      "'stream' is enabled; set 'stream': true or remove 'stream_options'")
        return v

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _penalty(cls, v, info):
        return _neutral(info.field_name, v, (0, 0.0, None))

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        return _neutral("logit_bias", v, (None, {}))

    def stops(self) -> list[str]:
        return [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: ``prompt`` a non-empty string, a list of 1..64 of them, or, as
    OpenAI's API takes it, token ids: one prompt as a non-empty list of ids (ints >= 0) or a list
    of 1..64 such lists. Ids are checked against the model's vocabulary by
    :meth:`zerotron.serve.api.Front.submit`."""

    prompt: (Text | Annotated[list[Text], Field(min_length=1, max_length=MAX_PROMPTS)] | TokenIds
             | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)])
    echo: Any = None
    logprobs: Any = None
    best_of: Any = None
    suffix: Any = None

    @field_validator("prompt")
    @classmethod
    def _prompt_text(cls, v):
        for s in [v] if isinstance(v, str) else v:
            if isinstance(s, str):
                _unicode(s, "prompt")
        return v

    @field_validator("echo", "logprobs", "best_of", "suffix")
    @classmethod
    def _unsupported(cls, v, info):
        return _neutral(info.field_name, v, {"echo": (False, None), "logprobs": (None,), "best_of": (None, 1),
                                             "suffix": (None, "")}[info.field_name])

    def prompts(self) -> list[str | list[int]]:
        """The prompts: each a string or a list of token ids."""
        p = self.prompt
        return [p] if isinstance(p, str) or isinstance(p[0], int) else list(p)


class _TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One chat message: ``role`` and ``content`` (a string, or a list of ``{"type": "text"}`` parts)."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[_TextPart]
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _content_text(cls, v):
        _unicode(v if isinstance(v, str) else "".join(p.text for p in v), "messages")
        return v

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(_Sampling):
    """``POST /v1/chat/completions``: ``messages`` (at least one); ``max_completion_tokens`` is
    OpenAI's newer name of ``max_tokens`` (give at most one)."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(strict=True, ge=0)] | None = None
    logprobs: Any = None
    top_logprobs: Any = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    response_format: Any = None

    @field_validator("logprobs", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls", "response_format")
    @classmethod
    def _unsupported(cls, v, info):
        return _neutral(info.field_name, v, {"logprobs": (None, False), "top_logprobs": (None,), "tools": (None, []),
                                             "tool_choice": (None, "none"), "parallel_tool_calls": (None, False, True),
                                             "response_format": (None, {"type": "text"})}[info.field_name])


def _member_tag(x) -> bool:
    """Whether a pydantic error location part names a union member ("constrained-str",
    "list[constrained-str]"), not a field or list index: left out of the field path shown."""
    return isinstance(x, str) and (not x.isidentifier() or x in ("str", "int", "float", "bool", "list", "dict"))


def _member_type_mismatch(err: dict) -> bool:
    return err["type"].endswith("_type") and any(_member_tag(x) for x in err["loc"]) and \
        not any(isinstance(x, int) for x in err["loc"])


def _item_index(err: dict) -> int:
    """The first list index in a pydantic error location (how far into a list the member read)."""
    return next((x for x in err["loc"] if isinstance(x, int)), -1)


def validate(model: type[BaseModel], body) -> BaseModel:
    """``model.model_validate(body)``; raises RequestError 400 naming the first bad field
    (``param``: its top-level name; ``code``: "unknown_parameter" / "unsupported_parameter" / None)."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        errs = e.errors(include_url=False)
        err = errs[0]
        # a union field (prompt: text, texts, token ids or lists of them; stop: a string or a list of
        # them) fails once per member; report the member the input was meant for: one whose type
        # matched but whose value did not (a negative id), else the list member that read furthest
        # into the input before a wrong item (["a", 3]: texts; [1, "a"]: ids), not the first member
        same = [x for x in errs if x["loc"][:1] == err["loc"][:1]]
        value = [x for x in same if not x["type"].endswith("_type") and any(_member_tag(y) for y in x["loc"])]
        reach: dict = {}  # union member -> the index of its first wrong item
        for x in same:
            if not _member_type_mismatch(x):
                m = x["loc"][1] if len(x["loc"]) > 1 else None
                reach[m] = min(reach.get(m, _item_index(x)), _item_index(x))
        best = max(reach, key=reach.get, default=None)  # the first such member on a tie
        err = value[0] if value else next((x for x in same if not _member_type_mismatch(x)
                                           and (x["loc"][1] if len(x["loc"]) > 1 else None) == best), err)
        field = str(err["loc"][0]) if err["loc"] else None
        kind = err["type"]
        if kind == "extra_forbidden":
            names = ", ".join(n for n in model.model_fields)
            raise RequestError(f"unknown field {field!r}"[:200] + f"; valid fields: {names}", param=field[:100],
                               code="unknown_parameter") from None
        where = ".".join(str(x) for x in err["loc"] if not _member_tag(x))
        if kind == "missing":  # the whole path: a message without 'content' is 'messages.0.content'
            raise RequestError(f"'{where}' is required", param=field) from None
        if kind in ("unsupported_parameter", "unicode", "only_when_streaming"):  # our own messages
            raise RequestError(err["msg"], param=field, code=kind if kind == "unsupported_parameter" else None) from None
        raise RequestError(f"'{where}': {err['msg']}, got {err.get('input')!r}"[:300], param=field) from None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    text: str
    index: int
    logprobs: None = None
    finish_reason: Literal["stop", "length"] | None


class Completion(BaseModel):
    """A ``text_completion`` (also each streamed chunk, with one choice and ``usage`` None)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class _AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: _AssistantMessage
    logprobs: None = None
    finish_reason: Literal["stop", "length"]


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: None = None
    finish_reason: Literal["stop", "length"] | None = None


class ChatChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error answer: ``{"error": {"message", "type", "param", "code"}}`` (OpenAI's shape)."""

    error: ErrorBody
