"""``zerotron serve``: an OpenAI-compatible completions server on any inference layout.

Endpoints (FastAPI on uvicorn, :mod:`~zerotron.serve.http_api`): ``POST /v1/completions`` (prompt: a
string or a list of up to 64 strings; max_tokens (16; prompt + max_tokens must fit the context), temperature (1.0), top_p
(1.0), top_k (zerotron's extension), n (1..16), stop (a string or up to 4), seed (none: a random one per request), model
(optional: must be the served id), stream (false), stream_options.include_usage),
``POST /v1/chat/completions`` (messages rendered by the tokenizer's chat template or the default
of :mod:`~zerotron.serve.chat`; the same sampling fields, max_tokens default 256),
``GET /v1/models`` (and ``/v1/models/{model}``), ``GET /health`` (status, batching, counters: :class:`~zerotron.serve.api.ServeStats`),
``GET /metrics`` (Prometheus text, :mod:`~zerotron.serve.metrics`). Requests and answers are the
pydantic models of :mod:`~zerotron.serve.schemas`. Errors are JSON ``{"error": {"message", "type",
"param", "code"}}`` with 400 (bad field, bad JSON), 401 (``--api-key`` set and no or a wrong
``Authorization: Bearer`` key; ``/health`` needs none), 404 (unknown path or model), 405 (another
method), 408, 413 (body over ``--max-body-bytes``), 503 (draining); the server keeps serving, and a
keep-alive connection stays usable after an error.

Modules: :mod:`~zerotron.serve.validation` (RequestError, settings), :mod:`~zerotron.serve.schemas`
(pydantic request/response models), :mod:`~zerotron.serve.chat` (chat templates),
:mod:`~zerotron.serve.streaming` (stop strings, streamed text), :mod:`~zerotron.serve.api` (jobs
and OpenAI-shaped answers), :mod:`~zerotron.serve.metrics`, :mod:`~zerotron.serve.http_api`
(routes, server-sent events, the uvicorn thread), :mod:`~zerotron.serve.batching` (window
batcher, continuous scheduler), :mod:`~zerotron.serve.follow` (the rank-follow protocol),
:mod:`~zerotron.serve.command` (CLI), :mod:`~zerotron.serve.link` and :mod:`~zerotron.serve.frontend`
(the HTTP front end as a process of its own).

Process layout (DESIGN.md "Serving"): rank 0 runs the batcher; every piece of collective work is
broadcast to the other ranks first, which follow. The HTTP server (with tokenisation, chat
templates and the streamed events) runs in a process of its own, a child of rank 0
(``--frontend process``, the default: :mod:`~zerotron.serve.frontend`, joined to the batcher by
:mod:`~zerotron.serve.link`), so the engine loop never waits for the GIL while requests are parsed
and events encoded (vLLM V1's API server / EngineCore split; on the idle 2-core machine 1.3x the
tokens/s of the thread at 16 clients), or in a thread of rank 0's process (``--frontend thread``). ``--batching continuous``
(default): iteration-level batching, rows join and leave between decode steps
(:mod:`zerotron.inference.continuous`); ``--batching window``: requests arriving within
``--batch-window-ms`` form one batch run to its end (pipelines: ``--microbatches`` in flight).
Choice j of prompt i is sampled with seed ``seed + i * n + j``: with n = 1 exactly what
``zerotron generate --seed`` gives prompt i, so the texts are equal whoever shares the batch.
``stop`` strings end generation at the token that completes one (``completion_tokens`` counts up
to there), and the text is cut before the stop string; ``finish_reason`` is "stop" (eos or a stop
string) or "length".

Streaming (``"stream": true``): OpenAI-style server-sent events (``text/event-stream``, chunked),
one ``data: {...}\\n\\n`` event per piece of new text as the tokens are decoded (``choices[0]`` with
``text``, ``index``, ``finish_reason`` null until the choice's last event), then ``data:
[DONE]\\n\\n``. The pieces concatenate to the non-streamed text: text that could still turn into a
stop string, or an incomplete UTF-8 character, is held back until the next token decides it. With
window batching and dp > 1, the choices decoded on other replicas than rank 0's arrive as one piece
when their batch ends. A client that disconnects (streaming or not) cancels its rows under
continuous batching: they leave the batch at the next iteration, the others go on (window
batching runs the batch to its end). A prompt longer than the context, or a ``max_tokens`` that does
not fit beside it, gets 400 (``context_length_exceeded``).

SIGTERM (or SIGINT): new requests get 503, queued and running requests finish and are answered,
idle keep-alive connections are closed at once, the ranks stop, exit code 0 (also under ``--nproc``).
"""
from .api import Front, Job, Streamer
from .command import check_args, main, parser
from .streaming import StreamText, cut_at_stop
from .validation import RequestError, parse_completion

__all__ = ["main", "parser", "check_args", "parse_completion", "RequestError", "StreamText", "cut_at_stop",
           "Front", "Job", "Streamer"]
