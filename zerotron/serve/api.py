"""The OpenAI-shaped request side of ``zerotron serve`` (rank 0, the HTTP server's thread): a
validated body becomes a :class:`Job` (one row per prompt x choice) on the batcher's queue
(:meth:`Front.submit`); the answer (:meth:`Front.answer`) or the stream's events
(:class:`Streamer`) are built from the rows' tokens with the pydantic models of
:mod:`~zerotron.serve.schemas`. The HTTP layer (:mod:`~zerotron.serve.http_api`) waits for the
job and cancels it (``job.cancelled``) when the client goes away: under continuous batching its
rows leave the batch at the next iteration."""
from __future__ import annotations

import collections
import json
import queue
import threading
import time

from ..inference.request import is_eos
from .schemas import (
    ChatChoice,
    ChatChunk,
    ChatChunkChoice,
    ChatCompletion,
    ChatDelta,
    ChatRequest,
    Completion,
    CompletionChoice,
    CompletionRequest,
    Usage,
    validate,
)
from .streaming import StreamText, cut_at_stop
from .validation import MAX_TOKENS, RequestError, check_model, sampling

__all__ = ["Job", "Front", "ServeStats", "Streamer", "CHAT_MAX_TOKENS", "max_new_tokens", "wake_jobs", "sse"]

CHAT_MAX_TOKENS = 256  # a chat request's max_tokens when it gives none (OpenAI: up to the context)


def max_new_tokens(prompt: int, given: int | None, default: int, context: int | None, field: str = "max_tokens",
                   index: int = 0, prompt_param: str = "prompt") -> int:
    """The new-token limit of a row whose prompt has ``prompt`` tokens on a model of ``context``
    tokens (block_size; None: no limit), as OpenAI's API and vLLM do it: prompt + completion must
    fit the context. A ``given`` max_tokens (the request's ``field``) that does not fit is refused
    (RequestError 400, ``param`` = field, ``code`` "context_length_exceeded", naming the largest
    value that fits); without one, ``default`` is clamped to the room left (``context - prompt``,
    possibly 0: the answer then ends at once with finish_reason "length"). A prompt longer than
    the context is refused with 400 (``param`` = ``prompt_param``, ``index``: which prompt).
    With no context (``None``), a ``given`` over ``MAX_TOKENS`` is refused (400, ``param`` =
    field). This is the one bound of max_tokens: the schema's was ``MAX_TOKENS`` (4096) whatever
    the context, so a model of a longer context refused 5000 new tokens that fit it."""
    if context is None:
        if given is not None and given > MAX_TOKENS:
            raise RequestError(f"'{field}' is {given}; ask for at most {MAX_TOKENS} new tokens", param=field)
        return default if given is None else given
    if prompt > context:
        raise RequestError(f"prompt {index} has {prompt} tokens, more than the model's context of {context} tokens "
                           f"(block_size): shorten it", param=prompt_param, code="context_length_exceeded")
    room = context - prompt
    if given is None:
        return min(default, room)
    if given > room:
        raise RequestError(f"'{field}' is {given}, but prompt {index} has {prompt} tokens and the model's context is "
                           f"{context} tokens (block_size): prompt + {field} must fit it; ask for at most {room} "
                           f"new tokens or shorten the prompt", param=field, code="context_length_exceeded")
    return given


class ServeStats:
    """Counters shown by ``GET /health``: ``requests`` (requests answered by the batcher),
    ``batches`` (window batches decoded, or continuous iterations that admitted rows), ``steps``
    (continuous iterations), ``running`` (rows in the continuous batch now), ``cancelled_rows``
    (rows that left the batch because their client disconnected); paged KV cache (continuous
    batching): ``kv_blocks_used``/``kv_blocks_free`` (all dp replicas), ``prefix_hits``/
    ``prefix_misses`` (full prompt blocks found / not found cached), ``preemptions``,
    ``kv_slots_allocated``/``kv_slots_filled`` (slots of the blocks in use / of those, slots
    holding a cached token: the KV waste is 1 - filled / allocated); speculative
    decoding: ``spec_proposed``/``spec_accepted`` (draft tokens)."""

    def __init__(self):
        self.requests = self.batches = self.steps = self.running = self.cancelled_rows = 0
        self.kv_blocks_used = self.kv_blocks_free = self.prefix_hits = self.prefix_misses = self.preemptions = 0
        self.spec_proposed = self.spec_accepted = 0
        self.kv_slots_allocated = self.kv_slots_filled = 0


class Job:
    """One HTTP request's rows: ``requests`` (``zerotron.inference.Request``, one per prompt x
    choice); ``result[k]``: row k's new tokens once finished; ``events``: a deque of (row, token) as decoded,
    None at the end (streaming only); ``cancelled``: set when the client went away. Timings per
    row (``time.monotonic`` seconds): ``t0`` (submitted), ``first[k]``/``last[k]`` (its first and
    latest token, None before), ``ntok[k]``. ``wake``: called (from the batcher's thread) after
    each token and at the end, so a waiter need not poll."""

    def __init__(self, requests, stream: bool = False):
        self.requests, self.done, self.error = requests, threading.Event(), None
        self.result: list = [None] * len(requests)
        self.pending = len(requests)
        # a deque, not a queue.Queue: append/popleft need no lock (atomic under the GIL), so the batcher
        # never blocks on a mutex the HTTP thread holds while it waits for the GIL (a convoy per token)
        self.events: collections.deque | None = collections.deque() if stream else None
        self.cancelled = threading.Event()
        self.t0 = time.monotonic()
        self.first: list = [None] * len(requests)
        self.last: list = [None] * len(requests)
        self.ntok = [0] * len(requests)
        self.wake = None
        self.waker = None  # (event loop, asyncio.Event) of an HTTP waiter: see wake_jobs

    def token(self, k: int, tok: int, wake: bool = True) -> None:
        """Row ``k`` decoded ``tok``; ``wake``: wake the waiter now (a batcher that reports many
        tokens per step passes False and calls :func:`wake_jobs` once after the step)."""
        now = time.monotonic()
        if self.first[k] is None:
            self.first[k] = now
        self.last[k], self.ntok[k] = now, self.ntok[k] + 1
        if self.events is not None:
            self.events.append((k, tok))
        if wake and self.wake is not None:
            self.wake()

    def finish(self, error: str | None = None) -> None:
        """Mark the job answered (``error``: the message of a 500 / an error event)."""
        self.error = error
        self.done.set()
        if self.events is not None:
            self.events.append(None)
        if self.wake is not None:
            self.wake()

    def waiting_rows(self) -> int:
        """Rows with no token yet (0 once done)."""
        return 0 if self.done.is_set() else sum(f is None for f in self.first)


def _set_all(events) -> None:
    for e in events:
        e.set()


def wake_jobs(jobs) -> None:
    """Wake the waiters of ``jobs`` (from the batcher's thread, once per step): the events of
    jobs waited on from one asyncio loop (``job.waker``) are set by one ``call_soon_threadsafe``
    (one wake-up of that loop per step, not one per row), other jobs get ``job.wake()``."""
    loops: dict = {}
    for j in jobs:
        if j.waker is not None:
            loops.setdefault(j.waker[0], []).append(j.waker[1])
        elif j.wake is not None:
            j.wake()
    for loop, events in loops.items():
        try:
            loop.call_soon_threadsafe(_set_all, events)
        except RuntimeError:  # the loop closed (server stopping): nobody waits
            pass


def sse(event: dict) -> bytes:
    """One server-sent event: ``data: {json}`` and a blank line."""
    return b"data: " + json.dumps(event).encode() + b"\n\n"


_MARK = "\x00zerotron-piece\x00"  # stands for a piece of text in a chunk template (JSON: "\u0000...")


class Front:
    """Rank 0's request side: validation, the job queue ``jobs`` the batcher reads, answers.
    ``tokenizer``: a ``tokenizers.Tokenizer`` (None in ``bench serve``, which builds jobs itself);
    ``chat``: a :class:`~zerotron.serve.chat.ChatTemplate` (None: the default template);
    ``context``: the model's block_size (longer prompts get 400; None: no limit); ``vocab``: the
    model's vocabulary size, the bound of token-id prompts (None: the tokenizer's)."""

    def __init__(self, tokenizer, eos_id, model_id: str, batching: str, chat=None, context: int | None = None,
                 vocab: int | None = None):
        from .metrics import Metrics

        self.tok, self.eos_id, self.model_id, self.batching = tokenizer, eos_id, model_id, batching
        self.jobs: queue.Queue = queue.Queue()
        self.draining = threading.Event()
        self.stats = ServeStats()
        self.metrics = Metrics()
        self.live: set = set()  # jobs submitted and not yet accounted (queue depth)
        self.counter = 0
        self._chat = chat
        self.context = context
        self.vocab = vocab

    @property
    def chat(self):
        if self._chat is None:
            from .chat import ChatTemplate

            first = self.eos_id if isinstance(self.eos_id, int) or self.eos_id is None else next(iter(self.eos_id), None)
            eos = self.tok.id_to_token(first) if self.tok is not None and first is not None else ""
            self._chat = ChatTemplate(None, eos or "")
        return self._chat

    def health(self) -> dict:
        s = self.stats
        return {"status": "draining" if self.draining.is_set() else "ok", "batching": self.batching,
                "batches": s.batches, "requests": s.requests, "steps": s.steps, "running": s.running,
                "cancelled_rows": s.cancelled_rows}

    def models(self) -> dict:
        return {"object": "list", "data": [self.model()]}

    def model(self, model_id: str | None = None) -> dict:
        """The served model's object (``GET /v1/models/{model}``: OpenAI's "retrieve model");
        RequestError 404 (code "model_not_found") for another ``model_id``."""
        check_model(model_id, self.model_id)
        return {"id": self.model_id, "object": "model", "created": 0, "owned_by": "zerotron"}

    def publish(self, jobs) -> None:
        """Wake the HTTP waiters of ``jobs`` (the batcher calls it once per step, after the step's
        tokens and ends: :func:`wake_jobs`)."""
        wake_jobs(jobs)

    def render_metrics(self) -> str:
        depth = sum(j.waiting_rows() for j in list(self.live))
        return self.metrics.render(depth, self.stats.running, self.stats.cancelled_rows, self.stats)

    def submit(self, body, chat: bool = False):
        """Validate ``body`` (a completions or, with ``chat``, a chat completions body) and enqueue
        its job; returns (settings dict, job). Raises RequestError (400 naming the field, 404
        another model, 503 while draining)."""
        from zerotron.inference.request import Request, SamplingParams

        if self.draining.is_set():
            raise RequestError("the server is shutting down", status=503, code="shutting_down")
        req = validate(ChatRequest if chat else CompletionRequest, body)
        check_model(req.model, self.model_id)
        c = sampling(req)
        if chat:
            try:
                prompts = [self.chat.render([{"role": m.role, "content": m.text()} for m in req.messages])]
            except ValueError as e:
                raise RequestError(str(e), param="messages") from None
        else:
            prompts = req.prompts()
        given = c["max_tokens"]
        field = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) is not None else "max_tokens"
        default = CHAT_MAX_TOKENS if chat else 16  # OpenAI's default for completions
        c["max_tokens"] = default if given is None else given
        c["chat"], c["prompt_tokens"], reqs = chat, 0, []
        for i, text in enumerate(prompts):
            ids = self.tok.encode(text).ids if isinstance(text, str) else self.token_ids(text, i)
            if not ids:
                raise RequestError(f"prompt {i} is empty after tokenization", param="prompt")
            limit = max_new_tokens(len(ids), given, default, self.context, field, i, "messages" if chat else "prompt")
            c["prompt_tokens"] += len(ids)
            for j in range(c["n"]):  # choice j of prompt i: seed + i * n + j (zerotron generate's for n = 1)
                reqs.append(Request(ids, SamplingParams(max_tokens=limit, temperature=float(c["temperature"]),
                                                        top_k=c["top_k"], top_p=float(c["top_p"]),
                                                        seed=c["seed"] + i * c["n"] + j, stop=tuple(c["stop"]))))
        job = Job(reqs, c["stream"])
        self.live.add(job)
        self.jobs.put(job)
        return c, job

    def token_ids(self, ids: list[int], index: int) -> list[int]:
        """A prompt given as token ids (ints >= 0, checked by the schema): ``ids``, or RequestError
        400 naming prompt ``index`` and the first id outside the model's vocabulary (``vocab``,
        else the tokenizer's)."""
        vocab = self.vocab if self.vocab is not None else self.tok.get_vocab_size()
        bad = next((t for t in ids if t >= vocab), None)
        if bad is not None:
            raise RequestError(f"prompt {index} has token id {bad}, outside the model's vocabulary of {vocab} ids "
                               f"(0..{vocab - 1}): give ids below {vocab} or the prompt as text", param="prompt")
        return list(ids)

    def account(self, job) -> None:
        """Count a job that ended (answered, failed or cancelled) in the metrics, once."""
        if job in self.live:
            self.live.discard(job)
            if job.done.is_set() and not job.error:
                self.metrics.job(job)

    def finish_reason(self, new: list[int], stops: list[str]) -> str:
        stopped = cut_at_stop(self.tok.decode(new), stops)[1]
        return "stop" if stopped or (bool(new) and is_eos(new[-1], self.eos_id)) else "length"

    def head(self, chat: bool) -> dict:
        self.counter += 1
        return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{self.counter}", "created": int(time.time()),
                "model": self.model_id}

    @staticmethod
    def usage(c: dict, job) -> Usage:
        n_out = sum(len(new) for new in job.result)
        return Usage(prompt_tokens=c["prompt_tokens"], completion_tokens=n_out, total_tokens=c["prompt_tokens"] + n_out)

    def answer(self, c: dict, job) -> dict:
        """The JSON answer of a finished job (RequestError 500 if the engine failed). ``usage``
        counts each prompt once, however many choices ``n`` it has, and every choice's tokens."""
        if job.error:
            raise RequestError(job.error, status=500, code="internal_error")
        texts = [(cut_at_stop(self.tok.decode(new), c["stop"])[0], self.finish_reason(new, c["stop"]))
                 for new in job.result]
        if c["chat"]:
            return ChatCompletion(**self.head(True), usage=self.usage(c, job), choices=[
                ChatChoice(index=k, message={"content": t}, finish_reason=r) for k, (t, r) in enumerate(texts)
            ]).model_dump()
        return Completion(**self.head(False), usage=self.usage(c, job), choices=[
            CompletionChoice(text=t, index=k, finish_reason=r) for k, (t, r) in enumerate(texts)]).model_dump()


def _stepper(tok):
    """An incremental decoder of ``tok``: token id -> the text it completes or None (tokenizers'
    ``DecodeStream``, skipping special tokens as ``Tokenizer.decode`` does by default); None when
    ``tok`` is not a ``tokenizers.Tokenizer`` or tokenizers is older than 0.21 (then each push
    decodes every token so far)."""
    from tokenizers import Tokenizer

    try:
        from tokenizers.decoders import DecodeStream  # tokenizers >= 0.21
    except ImportError:
        return None
    if not isinstance(tok, Tokenizer):
        return None
    stream = DecodeStream(skip_special_tokens=True)
    return lambda t: stream.step(tok, t)


class Streamer:
    """The server-sent events of a streamed job: :meth:`start` (a chat's first chunk: the
    assistant role of every choice), :meth:`token` (one decoded token: the chunk of new text, if
    any), :meth:`end` (the rest of each choice with its finish_reason, then the usage chunk if
    ``stream_options.include_usage``; an ``error`` event if the engine failed). Each is a list of
    dicts to send as ``data: {json}``; the texts add up to the non-streamed answer."""

    def __init__(self, front: Front, c: dict, job: Job):
        self.front, self.c, self.job, self.chat = front, c, job, c["chat"]
        self.head = front.head(self.chat)
        self.texts = [StreamText(front.tok.decode, c["stop"], _stepper(front.tok)) for _ in job.requests]
        self._templates: dict[int, tuple[bytes, bytes]] = {}

    def _chunk(self, k: int, text: str | None, reason: str | None = None, role: bool = False) -> dict:
        if self.chat:
            delta = ChatDelta(role="assistant" if role else None, content=text)
            d = ChatChunk(**self.head, choices=[ChatChunkChoice(index=k, delta=delta, finish_reason=reason)]
                          ).model_dump(exclude={"usage"})
            d["choices"][0]["delta"] = delta.model_dump(exclude_none=True)  # OpenAI sends only the fields set
            return d
        return Completion(**self.head, choices=[CompletionChoice(text=text or "", index=k, finish_reason=reason)]
                          ).model_dump(exclude={"usage"})

    def token_sse(self, k: int, tok: int) -> bytes:
        """:meth:`token` as server-sent event bytes (b"" if no text is ready), without building
        the chunk's pydantic model per token: the chunk of choice k is encoded once with a marker
        for its text (:meth:`_chunk`, so the models stay the one definition of the format) and
        each piece is spliced in as a JSON string; the bytes equal ``sse(token(k, tok)[0])``."""
        piece = self.texts[k].push(tok)
        if not piece:
            return b""
        t = self._templates.get(k)
        if t is None:
            pre, post = sse(self._chunk(k, _MARK)).split(json.dumps(_MARK).encode())
            t = self._templates[k] = (pre, post)
        return t[0] + json.dumps(piece).encode() + t[1]

    def start(self) -> list[dict]:
        return [self._chunk(k, "", role=True) for k in range(len(self.texts))] if self.chat else []

    def token(self, k: int, tok: int) -> list[dict]:
        piece = self.texts[k].push(tok)
        return [self._chunk(k, piece)] if piece else []

    def end(self) -> list[dict]:
        job, c = self.job, self.c
        if job.error:
            return [{"error": {"message": job.error, "type": "server_error", "param": None, "code": "internal_error"}}]
        out = []
        for k, new in enumerate(job.result):  # tokens not streamed (other dp replicas), then the rest
            for tok in new[len(self.texts[k].tokens):]:
                self.texts[k].push(tok)
            rest = self.texts[k].finish()
            out.append(self._chunk(k, rest if rest or not self.chat else None,
                                   self.front.finish_reason(new, c["stop"])))
        if c["include_usage"]:
            u = self.front.usage(c, job).model_dump()
            out.append({**self.head, "object": "chat.completion.chunk" if self.chat else "text_completion",
                        "choices": [], "usage": u})
        return out
